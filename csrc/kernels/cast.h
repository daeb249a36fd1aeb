// FP16/BF16 casts with a fused scale (docs/algorithms.md §2).
// "half" below is float16 (IEEE binary16) or bfloat16, chosen by a DType
// (F16 or BF16); both round to nearest even and keep NaN a NaN.
// CUDA variants take device pointers and run on `stream`; nothing syncs.
#pragma once
#include <cstddef>

#include "dtype.h"
#include "stream.h"

namespace pycomm {
namespace kernels {

// y[i] = half(float(x[i] * scale)); *nonfinite = 1 if any y[i] is inf or NaN (overflow or NaN input), else 0.
void cast_to_half_cpu(const float* x, void* y, size_t n, DType half, float scale, int* nonfinite);
// y[i] = float(x[i]) * scale
void cast_to_float_cpu(const void* x, float* y, size_t n, DType half, float scale);
// acc[i] += float(x[i])
void accumulate_half_cpu(float* acc, const void* x, size_t n, DType half);
// y[i] = half(float(x[i]) * scale), half -> half (y == x allowed: in-place scaling)
void scale_half_cpu(const void* x, void* y, size_t n, DType half, float scale);

// Same on the GPU. `nonfinite` is a device int, set to 0 or 1 in stream order.
void cast_to_half_cuda(const float* x, void* y, size_t n, DType half, float scale, int* nonfinite, Stream stream);
void cast_to_float_cuda(const void* x, float* y, size_t n, DType half, float scale, Stream stream);
void accumulate_half_cuda(float* acc, const void* x, size_t n, DType half, Stream stream);

}  // namespace kernels
}  // namespace pycomm
