// DeviceOps over one CUDA device: pycomm's CUDA kernels (cast, onebit) on a
// stream of its own, synchronised after every operation, plus two small
// kernels of its own: the inf/NaN checks of a float32 buffer (with the
// optional mask) and of a float16/bfloat16 buffer, each setting one device
// flag. No torch or MPI headers.
#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../kernels/cast.h"
#include "../kernels/cuda_check.h"
#include "../kernels/onebit.h"
#include "device_ops.h"
#include "device_scope_cuda.h"

namespace pycomm {
namespace comm {
namespace {

using kernels::DType;

__global__ void nonfinite_f32_kernel(const float* __restrict__ x, const uint8_t* __restrict__ mask, size_t n,
                                     int* flag) {
  int bad = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    bad |= (!(fabsf(x[i]) <= 3.402823466e38f) && (!mask || mask[i])) ? 1 : 0;
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

__global__ void nonfinite_half_kernel(const uint16_t* __restrict__ x, size_t n, uint16_t exp, int* flag) {
  int bad = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    bad |= (x[i] & exp) == exp ? 1 : 0;
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

class CudaOps : public DeviceOps {
 public:
  explicit CudaOps(int device) : device_(device) {
    DeviceScope on(device_);
    PYCOMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    PYCOMM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&flag_), sizeof(int)));
  }
  // Never destroyed (see cuda_device_ops): the CUDA runtime may be gone at process exit, so
  // the stream and the flag are left to the driver's teardown. Working memory is the caller's
  // (the mover's compressed_memory, memory_mover.h).
  const char* name() const override { return "cuda"; }

  int cast_to_half(const float* x, void* y, size_t n, DType half, float scale) override {
    DeviceScope on(device_);
    kernels::cast_to_half_cuda(x, y, n, half, scale, flag_, stream_);
    return read_flag();
  }
  void cast_to_float(const void* x, float* y, size_t n, DType half) override {
    DeviceScope on(device_);
    kernels::cast_to_float_cuda(x, y, n, half, 1.0f, stream_);
    sync();
  }
  int any_nonfinite(const float* x, const uint8_t* mask, size_t n) override {
    DeviceScope on(device_);
    PYCOMM_CUDA_CHECK(cudaMemsetAsync(flag_, 0, sizeof(int), stream_));
    if (n) {
      nonfinite_f32_kernel<<<kernels::cuda::blocks_for(n), kernels::cuda::kThreads, 0, stream_>>>(x, mask, n, flag_);
      PYCOMM_CUDA_CHECK_LAUNCH();
    }
    return read_flag();
  }
  int any_nonfinite_half(const void* x, size_t n, DType half) override {
    DeviceScope on(device_);
    PYCOMM_CUDA_CHECK(cudaMemsetAsync(flag_, 0, sizeof(int), stream_));
    if (n) {
      const uint16_t exp = half == DType::F16 ? 0x7c00u : 0x7f80u;
      nonfinite_half_kernel<<<kernels::cuda::blocks_for(n), kernels::cuda::kThreads, 0, stream_>>>(
          static_cast<const uint16_t*>(x), n, exp, flag_);
      PYCOMM_CUDA_CHECK_LAUNCH();
    }
    return read_flag();
  }
  void onebit_compress(const float* x, float* residual, size_t n, size_t chunk, uint8_t* bits, float* scale,
                       const uint8_t* mask) override {
    DeviceScope on(device_);
    kernels::onebit_compress_cuda(x, residual, n, chunk, bits, scale, mask, stream_);
    sync();
  }
  void onebit_decompress(const uint8_t* bits, const float* scale, size_t n, size_t chunk, float* out,
                         const uint8_t* mask) override {
    DeviceScope on(device_);
    kernels::onebit_decompress_cuda(bits, scale, n, chunk, out, mask, stream_);
    sync();
  }
  void onebit_decompress_accumulate(const uint8_t* bits, const float* scale, size_t n, size_t chunk, float* out,
                                    float weight, const uint8_t* mask) override {
    DeviceScope on(device_);
    kernels::onebit_decompress_accumulate_cuda(bits, scale, n, chunk, out, weight, mask, stream_);
    sync();
  }
  void fill_zero(void* p, size_t bytes) override {
    DeviceScope on(device_);
    PYCOMM_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    sync();
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    DeviceScope on(device_);
    PYCOMM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    sync();
  }

 private:
  void sync() { PYCOMM_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  int read_flag() {
    int host = 0;
    PYCOMM_CUDA_CHECK(cudaMemcpyAsync(&host, flag_, sizeof(int), cudaMemcpyDeviceToHost, stream_));
    sync();
    return host;
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  int* flag_ = nullptr;
};

}  // namespace

namespace {
std::mutex& tables_mu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
std::vector<CudaOps*>& tables() {
  static std::vector<CudaOps*>* t = new std::vector<CudaOps*>();  // leaked on purpose: see CudaOps
  return *t;
}
}  // namespace

DeviceOps& cuda_device_ops(int device) {
  std::lock_guard<std::mutex> lock(tables_mu());
  if (device < 0) device = 0;
  if (tables().size() <= static_cast<size_t>(device)) tables().resize(static_cast<size_t>(device) + 1, nullptr);
  CudaOps*& t = tables()[static_cast<size_t>(device)];
  if (!t) t = new CudaOps(device);
  return *t;
}

}  // namespace comm
}  // namespace pycomm
