// How bytes move between a buffer's memory (a GPU, or host memory standing
// in for one) and host staging memory, and how that memory is reduced in
// place. No MPI or torch here, so the CUDA implementation (staging_cuda.cu)
// compiles with plain nvcc.
#pragma once
#include <cstddef>
#include <memory>

#include "../kernels/dtype.h"

namespace pycomm {
namespace comm {

// Copies are asynchronous and run in order per lane (a CUDA stream on GPUs).
class MemoryMover {
 public:
  virtual ~MemoryMover() = default;
  virtual void* alloc_staging(size_t bytes) = 0;  // pinned host memory where it matters
  virtual void free_staging(void* p) = 0;
  virtual void to_host_async(void* host, const void* src, size_t bytes, int lane) = 0;
  virtual void to_device_async(void* dst, const void* host, size_t bytes, int lane) = 0;
  virtual void wait_lane(int lane) = 0;  // every copy issued on `lane` has finished

  // Working memory of the buffer's kind and synchronous operations on it, for
  // algorithms that run on device memory directly (a CUDA-aware MPI): the
  // ring's receive slots and its reductions (on the GPU, with pycomm's CUDA
  // kernels). Each returns once the memory holds the result.
  virtual void* alloc_device(size_t bytes) = 0;
  virtual void free_device(void* p) = 0;
  virtual void reduce(void* dst, const void* src, size_t count, kernels::DType dtype, kernels::ReduceOp op) = 0;
  virtual void scale(void* dst, size_t count, kernels::DType dtype, double factor) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
};

// CUDA streams and pinned host memory on `device` (staging_cuda.cu; CUDA builds only).
std::unique_ptr<MemoryMover> make_cuda_mover(int device);

// Whether the MPI library can read and write CUDA device memory itself
// (MPIX_Query_cuda_support where the implementation has it; PYCOMM_CUDA_AWARE
// overrides). Defined in staging.cpp.
bool mpi_is_cuda_aware();

}  // namespace comm
}  // namespace pycomm
