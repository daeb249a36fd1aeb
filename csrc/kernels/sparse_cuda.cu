// Top-k / threshold sparsification with error feedback on CUDA (math in sparse.h).
//
// select: acc = x + e is written into the residual (grid-stride); the k-th
// largest key is found by a radix select over the 31 key bits (four passes of
// a 256-bin histogram: 8, 8, 8 and 7 bits), which yields the key T of the k-th
// element and how many elements equal to T are taken (those of lowest index,
// per the order in sparse.h). One block then compacts the selected elements in
// index order (a block-wide prefix sum per tile), so the indices come out
// ascending and the selection is deterministic. Not tuned for speed: the
// compaction is one block.
// scatter: memset, one launch per row in rank order (indices within a row are
// distinct, so a row's adds never collide), then a scale.
#include "cuda_check.h"
#include "sparse.h"

namespace pycomm {
namespace kernels {
namespace {

constexpr int kBins = 256;
constexpr int kScanThreads = 1024;

__device__ __forceinline__ uint32_t key_of(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__global__ void count_kernel(const float* x, const float* e, size_t n, uint32_t t, unsigned long long* count) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    local += key_of(x[i] + e[i]) >= t;
  if (local) atomicAdd(count, local);
}

__global__ void accumulate_kernel(const float* x, float* e, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    e[i] = x[i] + e[i];
}

// state[0] = prefix (key bits fixed so far), state[1] = elements still to take among keys with that prefix.
__global__ void histogram_kernel(const float* acc, size_t n, const uint32_t* state, uint32_t mask_hi, int shift,
                                 uint32_t digit_mask, unsigned long long* hist) {
  __shared__ unsigned int local[kBins];
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const uint32_t prefix = state[0];
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint32_t k = key_of(acc[i]);
    if ((k & mask_hi) == prefix) atomicAdd(&local[(k >> shift) & digit_mask], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x)
    if (local[b]) atomicAdd(&hist[b], static_cast<unsigned long long>(local[b]));
}

// Walks the bins from the top: fixes the digit of the k-th key and the count still to take.
__global__ void pick_digit_kernel(unsigned long long* hist, uint32_t* state, int shift, int bins) {
  unsigned long long need = state[1];
  for (int b = bins - 1; b >= 0; --b) {
    if (hist[b] >= need) {
      state[0] |= static_cast<uint32_t>(b) << shift;
      state[1] = static_cast<uint32_t>(need);
      break;
    }
    need -= hist[b];
  }
  for (int b = 0; b < kBins; ++b) hist[b] = 0;
}

// One block: keeps keys > T, and the first `ties` keys == T in index order.
__global__ void compact_kernel(float* acc, size_t n, const uint32_t* state, int32_t* indices, float* values) {
  __shared__ unsigned int sel[kScanThreads];
  __shared__ unsigned int eq[kScanThreads];
  __shared__ unsigned long long base_sel, base_eq;
  const uint32_t t = state[0];
  const unsigned long long ties = state[1];
  if (threadIdx.x == 0) base_sel = base_eq = 0;
  __syncthreads();
  for (size_t tile = 0; tile < n; tile += blockDim.x) {
    const size_t i = tile + threadIdx.x;
    uint32_t k = 0;
    bool in = i < n;
    if (in) k = key_of(acc[i]);
    const unsigned int is_eq = in && k == t;
    eq[threadIdx.x] = is_eq;
    __syncthreads();
    for (unsigned int off = 1; off < blockDim.x; off <<= 1) {  // inclusive scan of eq
      unsigned int v = threadIdx.x >= off ? eq[threadIdx.x - off] : 0;
      __syncthreads();
      eq[threadIdx.x] += v;
      __syncthreads();
    }
    const unsigned long long eq_rank = base_eq + eq[threadIdx.x] - is_eq;  // equal keys before i
    const unsigned int take = in && (k > t || (is_eq && eq_rank < ties));
    sel[threadIdx.x] = take;
    __syncthreads();
    for (unsigned int off = 1; off < blockDim.x; off <<= 1) {
      unsigned int v = threadIdx.x >= off ? sel[threadIdx.x - off] : 0;
      __syncthreads();
      sel[threadIdx.x] += v;
      __syncthreads();
    }
    if (take) {
      const unsigned long long pos = base_sel + sel[threadIdx.x] - 1;
      indices[pos] = static_cast<int32_t>(i);
      values[pos] = acc[i];
      acc[i] = 0.0f;
    }
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) {
      base_sel += sel[threadIdx.x];
      base_eq += eq[threadIdx.x];
    }
    __syncthreads();
  }
}

__global__ void scatter_row_kernel(const int32_t* idx, const float* val, size_t k, float* out, size_t n) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t i = static_cast<size_t>(static_cast<uint32_t>(idx[j]));
    if (i < n) out[i] += val[j];
  }
}

__global__ void scale_kernel(float* out, size_t n, float s) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] *= s;
}

}  // namespace

size_t sparse_count_above_cuda(const float* x, const float* residual, size_t n, float threshold, Stream stream) {
  if (n == 0) return 0;
  unsigned long long* d = nullptr;
  PYCOMM_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&d), sizeof *d, stream));
  PYCOMM_CUDA_CHECK(cudaMemsetAsync(d, 0, sizeof *d, stream));
  uint32_t t;
  memcpy(&t, &threshold, sizeof t);
  count_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, stream>>>(x, residual, n, t & 0x7fffffffu, d);
  PYCOMM_CUDA_CHECK_LAUNCH();
  unsigned long long h = 0;
  PYCOMM_CUDA_CHECK(cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, stream));
  PYCOMM_CUDA_CHECK(cudaFreeAsync(d, stream));
  PYCOMM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return static_cast<size_t>(h);
}

void sparse_select_cuda(const float* x, float* residual, size_t n, size_t k, int32_t* indices, float* values,
                        Stream stream) {
  if (k > n) k = n;
  if (n == 0) return;
  const unsigned blocks = cuda::blocks_for(n);
  accumulate_kernel<<<blocks, cuda::kThreads, 0, stream>>>(x, residual, n);
  PYCOMM_CUDA_CHECK_LAUNCH();
  if (k == 0) return;
  // scratch: 256 bins (u64) + state {prefix, still to take}
  void* scratch = nullptr;
  const size_t bytes = kBins * sizeof(unsigned long long) + 2 * sizeof(uint32_t);
  PYCOMM_CUDA_CHECK(cudaMallocAsync(&scratch, bytes, stream));
  PYCOMM_CUDA_CHECK(cudaMemsetAsync(scratch, 0, bytes, stream));
  auto* hist = static_cast<unsigned long long*>(scratch);
  auto* state = reinterpret_cast<uint32_t*>(hist + kBins);
  const uint32_t need = static_cast<uint32_t>(k);
  PYCOMM_CUDA_CHECK(cudaMemcpyAsync(state + 1, &need, sizeof need, cudaMemcpyHostToDevice, stream));
  // Digits of the 31-bit key, from the top: bits 30..23 (8), 22..15, 14..7, 6..0 (7).
  const int shifts[4] = {23, 15, 7, 0};
  const int widths[4] = {8, 8, 8, 7};
  uint32_t mask_hi = 0;  // bits above the current digit
  for (int d = 0; d < 4; ++d) {
    histogram_kernel<<<blocks, cuda::kThreads, 0, stream>>>(residual, n, state, mask_hi, shifts[d],
                                                             (1u << widths[d]) - 1u, hist);
    PYCOMM_CUDA_CHECK_LAUNCH();
    pick_digit_kernel<<<1, 1, 0, stream>>>(hist, state, shifts[d], 1 << widths[d]);
    PYCOMM_CUDA_CHECK_LAUNCH();
    mask_hi |= ((1u << widths[d]) - 1u) << shifts[d];
  }
  compact_kernel<<<1, kScanThreads, 0, stream>>>(residual, n, state, indices, values);
  PYCOMM_CUDA_CHECK_LAUNCH();
  PYCOMM_CUDA_CHECK(cudaFreeAsync(scratch, stream));
}

void sparse_scatter_cuda(const int32_t* indices, const float* values, size_t rows, size_t k, float* out, size_t n,
                         float scale, Stream stream) {
  if (n == 0) return;
  PYCOMM_CUDA_CHECK(cudaMemsetAsync(out, 0, n * sizeof(float), stream));
  if (k)
    for (size_t r = 0; r < rows; ++r) {
      scatter_row_kernel<<<cuda::blocks_for(k), cuda::kThreads, 0, stream>>>(indices + r * k, values + r * k, k, out,
                                                                             n);
      PYCOMM_CUDA_CHECK_LAUNCH();
    }
  if (scale != 1.0f) {
    scale_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, stream>>>(out, n, scale);
    PYCOMM_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace kernels
}  // namespace pycomm
