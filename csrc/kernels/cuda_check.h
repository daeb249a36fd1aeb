// Shared by the .cu kernels (internal): CUDA error checks, launch sizing,
// fp16/bf16 bit conversions, 16-byte packs for vectorized loads.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "stream.h"

// Every CUDA runtime call goes through this; a failure throws with the call, file and line.
#define PYCOMM_CUDA_CHECK(expr)                                                                        \
  do {                                                                                                 \
    cudaError_t pycomm_err_ = (expr);                                                                  \
    if (pycomm_err_ != cudaSuccess)                                                                    \
      throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(pycomm_err_) + " in " + \
                               #expr + " at " + __FILE__ + ":" + std::to_string(__LINE__));            \
  } while (0)

// After every <<<...>>> launch.
#define PYCOMM_CUDA_CHECK_LAUNCH() PYCOMM_CUDA_CHECK(cudaGetLastError())

namespace pycomm {
namespace kernels {
namespace cuda {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over `items` work items of `per_block` each:
// enough to fill the device (8 blocks per SM), never more than needed.
inline unsigned blocks_for(size_t items, size_t per_block = kThreads) {
  static thread_local int cached_device = -1, cached_sms = 0;
  int dev = 0;
  PYCOMM_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev != cached_device) {
    PYCOMM_CUDA_CHECK(cudaDeviceGetAttribute(&cached_sms, cudaDevAttrMultiProcessorCount, dev));
    cached_device = dev;
  }
  size_t want = (items + per_block - 1) / per_block;
  size_t cap = static_cast<size_t>(cached_sms) * 8;
  if (want > cap) want = cap;
  return static_cast<unsigned>(want < 1 ? 1 : want);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__device__ __forceinline__ float f16_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ uint16_t float_to_f16(float f) { return __half_as_ushort(__float2half_rn(f)); }
__device__ __forceinline__ float bf16_to_float(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }
__device__ __forceinline__ uint16_t float_to_bf16(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

template <bool BF16>
__device__ __forceinline__ float half_to_float(uint16_t h) {
  return BF16 ? bf16_to_float(h) : f16_to_float(h);
}
template <bool BF16>
__device__ __forceinline__ uint16_t float_to_half(float f) {
  return BF16 ? float_to_bf16(f) : float_to_f16(f);
}

// 16 bytes of T, loaded and stored as one vector.
template <class T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

}  // namespace cuda
}  // namespace kernels
}  // namespace pycomm
