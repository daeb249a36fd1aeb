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
#include <map>
#include <mutex>

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

  // Working memory of this kind for the operation an engine runs now (one
  // at a time per engine; `owner` names the engine, so engines of different
  // groups never share a block), kept between operations and regrown to
  // max(request, 2 x its size) when too small: a steady stream of compressed
  // allreduces allocates nothing. Never above the cache limit
  // (PYCOMM_DEVICE_CACHE_MB, as the movers'): a larger request gets memory of
  // its own, freed when its Workspace ends. Separate from
  // MemoryMover::working_memory, which the ring underneath leases at the same time.
  class Workspace {
   public:
    Workspace(DeviceOps* ops, void* p, bool owned) : ops_(ops), p_(p), owned_(owned) {}
    Workspace(const Workspace&) = delete;
    Workspace& operator=(const Workspace&) = delete;
    Workspace(Workspace&& o) noexcept : ops_(o.ops_), p_(o.p_), owned_(o.owned_) { o.owned_ = false; }
    ~Workspace() {
      if (owned_) ops_->release(p_);
    }
    void* get() const { return p_; }

   private:
    DeviceOps* ops_;
    void* p_;
    bool owned_;
  };
  Workspace workspace(const void* owner, size_t bytes, size_t cache_limit);
  uint64_t workspace_bytes() const;
  uint64_t workspace_allocations() const;

 protected:
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;

 private:
  struct Block {
    void* p = nullptr;
    size_t bytes = 0;
  };
  mutable std::mutex mu_;  // guards the map; each block is used by its owner alone
  std::map<const void*, Block> blocks_;
  uint64_t allocations_ = 0;
  uint64_t uncached_ = 0;  // workspaces above the cache limit (allocated per call)
};

// The workspaces of every table made so far in this process (pycomm.stats():
// device_cache_bytes, device_cache_allocations).
struct WorkspaceStats {
  uint64_t bytes = 0, allocations = 0;
};
WorkspaceStats device_ops_workspace_stats();
WorkspaceStats cuda_ops_workspace_stats();  // device_ops_cuda.cu; zero in CPU-only builds

// The table for host memory (one per process).
DeviceOps& cpu_device_ops();
// The table for CUDA device `device` (one per device; device_ops_cuda.cu,
// CUDA builds only; a CPU-only build throws CommError).
DeviceOps& cuda_device_ops(int device);

}  // namespace comm
}  // namespace pycomm
