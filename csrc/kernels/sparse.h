// Sparsification with error feedback: top-k and threshold model filtering
// (docs/algorithms.md §5b; Strom 2015, Aji & Heafield 2017).
//
// For n float32 elements x with residual e:
//   acc_i = x_i + e_i                          (float32, one rounding)
//   key_i = |acc_i| as the bits of the float with the sign cleared (uint32):
//           monotone in |acc_i|, NaN above +inf, so a NaN is always selected
//           (it reaches the result, where it can be seen, instead of hiding in
//           the residual).
// Order: key descending, then index ascending (a strict total order, so the
// selection is the same on every machine and every run).
//
// sparse_count_above: #{i : |acc_i| >= threshold} (threshold >= 0; NaN counts).
// sparse_select: the first k elements in that order; writes their indices in
//   ascending order and their acc values; residual <- acc with the selected
//   elements set to exactly 0. k is clamped to n.
// sparse_scatter: out[0..n) = 0; for r = 0..rows-1 (rank order) and j = 0..k-1:
//   out[indices[r k + j]] += values[r k + j]; then out *= scale (skipped for
//   scale 1). Indices of one row are distinct; an index >= n is ignored
//   (callers pass valid rows). The sum runs in rank order on every rank, so
//   every rank gets bitwise the same result.
//
// Indices are int32: n must be below 2^31 (the bindings check). CUDA variants
// take device pointers, run on `stream` and use stream-ordered scratch memory;
// sparse_count_above_cuda waits for the stream to return the count.
#pragma once
#include <cstddef>
#include <cstdint>

#include "stream.h"

namespace pycomm {
namespace kernels {

size_t sparse_count_above_cpu(const float* x, const float* residual, size_t n, float threshold);
void sparse_select_cpu(const float* x, float* residual, size_t n, size_t k, int32_t* indices, float* values);
void sparse_scatter_cpu(const int32_t* indices, const float* values, size_t rows, size_t k, float* out, size_t n,
                        float scale);

size_t sparse_count_above_cuda(const float* x, const float* residual, size_t n, float threshold, Stream stream);
void sparse_select_cuda(const float* x, float* residual, size_t n, size_t k, int32_t* indices, float* values,
                        Stream stream);
void sparse_scatter_cuda(const int32_t* indices, const float* values, size_t rows, size_t k, float* out, size_t n,
                         float scale, Stream stream);

}  // namespace kernels
}  // namespace pycomm
