// FP16/BF16 casts on the GPU: each thread of a grid-stride loop converts 8
// elements with 16/32-byte vector loads and stores (element by element when a
// pointer is not 16-byte aligned, and for the tail); the non-finite flag is
// OR-reduced per block with __syncthreads_or and set by one thread.
#include "cast.h"
#include "cuda_check.h"

namespace pycomm {
namespace kernels {
namespace {

using cuda::Pack;

__device__ __forceinline__ bool bad_half(uint16_t h, bool bf16) {
  return (h & 0x7fffu) >= (bf16 ? 0x7f80u : 0x7c00u);
}

template <bool BF16>
__global__ void to_half_kernel(const float* __restrict__ x, uint16_t* __restrict__ y, size_t n, float s,
                               int* __restrict__ flag, bool vec) {
  const size_t tid = blockIdx.x * size_t(blockDim.x) + threadIdx.x, stride = size_t(gridDim.x) * blockDim.x;
  int bad = 0;
  size_t done = 0;
  if (vec) {
    const size_t nv = n / 8;
    const auto* x4 = reinterpret_cast<const float4*>(x);
    auto* y8 = reinterpret_cast<Pack<uint16_t>*>(y);
    for (size_t i = tid; i < nv; i += stride) {
      float4 a = x4[2 * i], b = x4[2 * i + 1];
      float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      Pack<uint16_t> h;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        h.v[k] = cuda::float_to_half<BF16>(__fmul_rn(v[k], s));
        bad |= bad_half(h.v[k], BF16);
      }
      y8[i] = h;
    }
    done = nv * 8;
  }
  for (size_t i = done + tid; i < n; i += stride) {
    uint16_t h = cuda::float_to_half<BF16>(__fmul_rn(x[i], s));
    y[i] = h;
    bad |= bad_half(h, BF16);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

template <bool BF16, bool ACC>
__global__ void to_float_kernel(const uint16_t* __restrict__ x, float* __restrict__ y, size_t n, float s, bool vec) {
  const size_t tid = blockIdx.x * size_t(blockDim.x) + threadIdx.x, stride = size_t(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (vec) {
    const size_t nv = n / 8;
    const auto* x8 = reinterpret_cast<const Pack<uint16_t>*>(x);
    auto* y4 = reinterpret_cast<float4*>(y);
    for (size_t i = tid; i < nv; i += stride) {
      Pack<uint16_t> h = x8[i];
      float v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = cuda::half_to_float<BF16>(h.v[k]);
      float4 a, b;
      if (ACC) {
        a = y4[2 * i];
        b = y4[2 * i + 1];
        a = make_float4(__fadd_rn(a.x, v[0]), __fadd_rn(a.y, v[1]), __fadd_rn(a.z, v[2]), __fadd_rn(a.w, v[3]));
        b = make_float4(__fadd_rn(b.x, v[4]), __fadd_rn(b.y, v[5]), __fadd_rn(b.z, v[6]), __fadd_rn(b.w, v[7]));
      } else {
        a = make_float4(__fmul_rn(v[0], s), __fmul_rn(v[1], s), __fmul_rn(v[2], s), __fmul_rn(v[3], s));
        b = make_float4(__fmul_rn(v[4], s), __fmul_rn(v[5], s), __fmul_rn(v[6], s), __fmul_rn(v[7], s));
      }
      y4[2 * i] = a;
      y4[2 * i + 1] = b;
    }
    done = nv * 8;
  }
  for (size_t i = done + tid; i < n; i += stride) {
    float v = cuda::half_to_float<BF16>(x[i]);
    y[i] = ACC ? __fadd_rn(y[i], v) : __fmul_rn(v, s);
  }
}

void check_half(DType t, const char* what) {
  if (t != DType::F16 && t != DType::BF16)
    throw std::invalid_argument(std::string(what) + ": the half type must be float16 or bfloat16, got " +
                                dtype_name(t));
}

}  // namespace

void cast_to_half_cuda(const float* x, void* y, size_t n, DType half, float scale, int* nonfinite, Stream stream) {
  check_half(half, "cast_to_half_cuda");
  if (nonfinite) PYCOMM_CUDA_CHECK(cudaMemsetAsync(nonfinite, 0, sizeof(int), stream));
  if (n == 0) return;
  int dummy_needed = nonfinite == nullptr;
  int* flag = nonfinite;
  if (dummy_needed) PYCOMM_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&flag), sizeof(int), stream));
  auto* out = static_cast<uint16_t*>(y);
  bool vec = cuda::aligned16(x) && cuda::aligned16(y);
  unsigned blocks = cuda::blocks_for(vec ? n / 8 + 1 : n);
  if (half == DType::BF16) to_half_kernel<true><<<blocks, cuda::kThreads, 0, stream>>>(x, out, n, scale, flag, vec);
  else to_half_kernel<false><<<blocks, cuda::kThreads, 0, stream>>>(x, out, n, scale, flag, vec);
  PYCOMM_CUDA_CHECK_LAUNCH();
  if (dummy_needed) PYCOMM_CUDA_CHECK(cudaFreeAsync(flag, stream));
}

void cast_to_float_cuda(const void* x, float* y, size_t n, DType half, float scale, Stream stream) {
  check_half(half, "cast_to_float_cuda");
  if (n == 0) return;
  const auto* in = static_cast<const uint16_t*>(x);
  bool vec = cuda::aligned16(x) && cuda::aligned16(y);
  unsigned blocks = cuda::blocks_for(vec ? n / 8 + 1 : n);
  if (half == DType::BF16) to_float_kernel<true, false><<<blocks, cuda::kThreads, 0, stream>>>(in, y, n, scale, vec);
  else to_float_kernel<false, false><<<blocks, cuda::kThreads, 0, stream>>>(in, y, n, scale, vec);
  PYCOMM_CUDA_CHECK_LAUNCH();
}

void accumulate_half_cuda(float* acc, const void* x, size_t n, DType half, Stream stream) {
  check_half(half, "accumulate_half_cuda");
  if (n == 0) return;
  const auto* in = static_cast<const uint16_t*>(x);
  bool vec = cuda::aligned16(x) && cuda::aligned16(acc);
  unsigned blocks = cuda::blocks_for(vec ? n / 8 + 1 : n);
  if (half == DType::BF16) to_float_kernel<true, true><<<blocks, cuda::kThreads, 0, stream>>>(in, acc, n, 1.0f, vec);
  else to_float_kernel<false, true><<<blocks, cuda::kThreads, 0, stream>>>(in, acc, n, 1.0f, vec);
  PYCOMM_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels
}  // namespace pycomm
