// Element-wise reductions: dst[i] = dst[i] op src[i].
// fp16/bf16 are widened to fp32, combined, and rounded once (round to nearest even).
#pragma once
#include <cstddef>

#include "dtype.h"
#include "stream.h"

namespace pycomm {
namespace kernels {

void reduce_cpu(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// dst[i] *= factor (floating types only); used for op="avg" after a sum.
void scale_cpu(void* dst, size_t count, DType dtype, double factor);

// The same on the GPU (device pointers, run on `stream`, no sync).
void reduce_cuda(void* dst, const void* src, size_t count, DType dtype, ReduceOp op, Stream stream);
void scale_cuda(void* dst, size_t count, DType dtype, double factor, Stream stream);

}  // namespace kernels
}  // namespace pycomm
