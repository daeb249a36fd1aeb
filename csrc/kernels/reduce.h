// Element-wise reductions: dst[i] = dst[i] op src[i], op = sum | min | max | prod,
// over every DType of dtype.h (the ring allreduce's kernel). Integers wrap
// around; bool: sum and max are a logical or, min and prod a logical and.
// fp16/bf16 are widened to fp32, combined, and rounded once (round to nearest even).
// Floating min/max: min = (src < dst ? src : dst), max likewise, and NaN if
// either is NaN (numpy.minimum/maximum). dst and src must not overlap.
#pragma once
#include <cstddef>

#include "dtype.h"
#include "stream.h"

namespace pycomm {
namespace kernels {

void reduce_cpu(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// dst[i] *= factor (floating types only; fp16/bf16 in fp32, rounded once); used for op="avg" after a sum.
void scale_cpu(void* dst, size_t count, DType dtype, double factor);

// The same on the GPU (device pointers, run on `stream`, no sync).
void reduce_cuda(void* dst, const void* src, size_t count, DType dtype, ReduceOp op, Stream stream);
void scale_cuda(void* dst, size_t count, DType dtype, double factor, Stream stream);

}  // namespace kernels
}  // namespace pycomm
