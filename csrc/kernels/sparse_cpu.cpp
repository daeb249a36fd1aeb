// Top-k / threshold sparsification with error feedback on the CPU (math in sparse.h).
// Selection: nth_element over the indices with the (key desc, index asc) order,
// then the k chosen indices sorted ascending: O(n) expected.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "sparse.h"

namespace pycomm {
namespace kernels {
namespace {

inline uint32_t key_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b & 0x7fffffffu;
}

inline uint32_t threshold_key(float t) {  // |acc| >= t  <=>  key(acc) >= key(t), for t >= 0 (NaN counts)
  return key_of(t);
}

}  // namespace

size_t sparse_count_above_cpu(const float* x, const float* residual, size_t n, float threshold) {
  const uint32_t t = threshold_key(threshold);
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) count += key_of(x[i] + residual[i]) >= t;
  return count;
}

void sparse_select_cpu(const float* x, float* residual, size_t n, size_t k, int32_t* indices, float* values) {
  if (k > n) k = n;
  std::vector<uint32_t> keys(n);
  for (size_t i = 0; i < n; ++i) {
    residual[i] = x[i] + residual[i];  // the residual holds acc from here on
    keys[i] = key_of(residual[i]);
  }
  if (k == 0) return;
  std::vector<int32_t> order;
  if (k < n) {
    order.resize(n);
    std::iota(order.begin(), order.end(), 0);
    auto before = [&](int32_t a, int32_t b) { return keys[a] != keys[b] ? keys[a] > keys[b] : a < b; };
    std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k - 1), order.end(), before);
    order.resize(k);
    std::sort(order.begin(), order.end());
  } else {
    order.resize(n);
    std::iota(order.begin(), order.end(), 0);
  }
  for (size_t j = 0; j < k; ++j) {
    const int32_t i = order[j];
    indices[j] = i;
    values[j] = residual[i];
    residual[i] = 0.0f;
  }
}

void sparse_scatter_cpu(const int32_t* indices, const float* values, size_t rows, size_t k, float* out, size_t n,
                        float scale) {
  std::fill(out, out + n, 0.0f);
  for (size_t r = 0; r < rows; ++r) {
    const int32_t* idx = indices + r * k;
    const float* val = values + r * k;
    for (size_t j = 0; j < k; ++j) {
      const size_t i = static_cast<size_t>(static_cast<uint32_t>(idx[j]));
      if (i < n) out[i] += val[j];
    }
  }
  if (scale != 1.0f)
    for (size_t i = 0; i < n; ++i) out[i] *= scale;
}

}  // namespace kernels
}  // namespace pycomm
