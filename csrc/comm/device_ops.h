// The kernels a compressed allreduce runs on the memory its tensor lives in,
// as one small table: the CUDA kernels (csrc/kernels/*_cuda.cu) on a GPU's
// memory, the CPU kernels on host memory. Host tensors under
// force_staging / force_device_direct take the CPU table, so every line of
// the device paths' control flow runs on CPUs; a CUDA build hands CUDA
// memory to the CUDA table. No MPI or torch here (device_ops_cuda.cu
// compiles with plain nvcc).
//
// Every operation is synchronous: it returns once the memory holds the
// result (the CUDA table runs on its own stream and synchronises that stream).
// Pointers are of the table's memory unless named `host_*`.
#pragma once
#include <cstddef>
#include <cstdint>

#include "../kernels/dtype.h"

namespace pycomm {
namespace comm {

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  virtual const char* name() const = 0;  // "cpu" or "cuda"

  // y = half(x * scale) (cast.h); returns 1 if any y is inf or NaN.
  virtual int cast_to_half(const float* x, void* y, size_t n, kernels::DType half, float scale) = 0;
  // y = float(x)
  virtual void cast_to_float(const void* x, float* y, size_t n, kernels::DType half) = 0;
  // 1 if any kept element (mask byte != 0, or no mask) is inf or NaN.
  virtual int any_nonfinite(const float* x, const uint8_t* mask, size_t n) = 0;
  // 1 if any element of the float16/bfloat16 buffer is inf or NaN.
  virtual int any_nonfinite_half(const void* x, size_t n, kernels::DType half) = 0;
  // onebit.h, one chunk at a time (`scale` is one float of this memory).
  virtual void onebit_compress(const float* x, float* residual, size_t n, size_t chunk, uint8_t* bits, float* scale,
                               const uint8_t* mask) = 0;
  virtual void onebit_decompress(const uint8_t* bits, const float* scale, size_t n, size_t chunk, float* out,
                                 const uint8_t* mask) = 0;
  virtual void onebit_decompress_accumulate(const uint8_t* bits, const float* scale, size_t n, size_t chunk,
                                            float* out, float weight, const uint8_t* mask) = 0;
  virtual void fill_zero(void* p, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // within this memory (unaligned is fine)
};

// The table for host memory (one per process).
DeviceOps& cpu_device_ops();
// The table for CUDA device `device` (one per device; device_ops_cuda.cu,
// CUDA builds only; a CPU-only build throws CommError).
DeviceOps& cuda_device_ops(int device);

}  // namespace comm
}  // namespace pycomm
