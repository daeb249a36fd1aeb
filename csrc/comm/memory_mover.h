// How bytes move between a buffer's memory (a GPU, or host memory standing
// in for one) and host staging memory, and how that memory is reduced in
// place. No MPI or torch here, so the CUDA implementation (cuda_mover.cu)
// compiles with plain nvcc.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "../kernels/dtype.h"
#include "device_event.h"
#include "peer_memory.h"

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
  // Everything issued on either lane so far is ordered before what lane 0 runs next and before
  // record_done(), without blocking the host where the memory has streams: on CUDA lane 0 waits
  // for lane 1 on the device; the host stand-in (whose events order nothing) waits for both lanes.
  virtual void join_lanes() = 0;
  // The lane's stream (a cudaStream_t) where the memory has streams; nullptr for the host stand-in.
  // The bindings record submitted CUDA tensors on both lanes (recordStream), so torch's caching
  // allocator reuses their memory only after the lanes' work on it, which the host no longer waits for.
  virtual void* lane_stream(int lane) const { (void)lane; return nullptr; }

  // Working memory of the buffer's kind and synchronous operations on it, for
  // algorithms that run on device memory directly (a CUDA-aware MPI): the
  // ring's receive slots and its reductions (on the GPU, with pycomm's CUDA
  // kernels). Each returns once the memory holds the result.
  virtual void* alloc_device(size_t bytes) = 0;
  virtual void free_device(void* p) = 0;
  virtual void reduce(void* dst, const void* src, size_t count, kernels::DType dtype, kernels::ReduceOp op) = 0;
  virtual void scale(void* dst, size_t count, kernels::DType dtype, double factor) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;

  // Tensor fusion on the buffer's memory (fusion.h): flat[off_k + i] = srcs[k][i], and back with
  // the average's scale fused in. The CUDA pack/unpack kernels on a GPU, the CPU kernels on the host
  // stand-in. Stream-ordered, not host-synchronous: pack runs on lane 0 and both lanes' later work
  // follows it; unpack follows everything issued on either lane (join_lanes) and record_done()
  // follows it. Whoever hands `flat` to MPI after pack waits for lane 0 first.
  virtual void pack(const void* const* srcs, const size_t* counts, size_t num, void* flat, kernels::DType dtype) = 0;
  virtual void unpack(const void* flat, void* const* dsts, const size_t* counts, size_t num, kernels::DType dtype,
                      double scale) = 0;

  // Memory of this kind that the node's other processes can map, with its work on lane 0 (the peer
  // path, peer_memory.h): CUDA IPC on a GPU, POSIX shared memory on the host stand-in.
  virtual std::unique_ptr<PeerMemory> peer_memory() = 0;

  // Stream order (device_event.h): make every lane wait for `producer` (no host block), and record
  // an event after everything issued on the lanes so far.
  virtual void wait_event(DeviceEvent& producer) = 0;
  virtual EventPtr record_done() = 0;

  // Memory of the buffer's kind kept between operations (an engine runs one
  // operation at a time): a request that does not fit regrows the block to
  // max(request, 2 x its size), so a steady stream of allreduces allocates
  // nothing -- on a GPU no cudaMalloc, and no cudaFree, which synchronises
  // the device. The block never exceeds the cache limit
  // (PYCOMM_DEVICE_CACHE_MB); a larger request gets memory of its own, freed
  // when its Lease ends. Three blocks, since one operation may hold all three
  // at once: the algorithms' working memory (the ring's receive slots), the
  // fusion buffer, which holds the packed tensors while the algorithm runs on
  // it, and the compressed allreduce's workspace (its half buffer, or
  // onebit's wire buffers and sums), which it holds while the ring underneath
  // leases working memory. This is the one cache of every operation's
  // working memory: the host mover serves host tensors and the host stand-ins.
  class Lease {
   public:
    Lease(MemoryMover* mover, void* p, bool owned) : mover_(mover), p_(p), owned_(owned) {}
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lease(Lease&& o) noexcept : mover_(o.mover_), p_(o.p_), owned_(o.owned_) { o.owned_ = false; }
    ~Lease() {
      if (owned_) mover_->free_device(p_);
    }
    void* get() const { return p_; }

   private:
    MemoryMover* mover_;
    void* p_;
    bool owned_;
  };
  Lease working_memory(size_t bytes) { return lease(working_, bytes); }
  Lease fusion_memory(size_t bytes) { return lease(fusion_, bytes); }
  Lease compressed_memory(size_t bytes) { return lease(compressed_, bytes); }
  size_t cached_bytes() const { return working_.bytes; }
  uint64_t allocations() const { return working_.allocations; }  // blocks allocated by working_memory()
  size_t fusion_bytes() const { return fusion_.bytes; }
  uint64_t fusion_allocations() const { return fusion_.allocations; }  // blocks allocated by fusion_memory()
  size_t compressed_bytes() const { return compressed_.bytes; }
  uint64_t compressed_allocations() const { return compressed_.allocations; }  // by compressed_memory()
  void set_cache_limit(size_t bytes) { cache_limit_ = bytes; }
  // Requests above the cache limit (memory of their own, allocated and freed per call).
  uint64_t uncached_allocations() const { return uncached_; }
  size_t cache_limit() const { return cache_limit_; }

 protected:
  // Derived destructors call this (free_device is theirs).
  void drop_cache() {
    drop(working_);
    drop(fusion_);
    drop(compressed_);
  }

 private:
  struct Cache {
    void* p = nullptr;
    size_t bytes = 0;
    uint64_t allocations = 0;
  };
  Lease lease(Cache& c, size_t bytes) {
    if (c.p && bytes <= c.bytes) return Lease(this, c.p, false);
    size_t want = std::max(bytes, c.bytes * 2);
    if (want > cache_limit_) want = bytes;
    ++c.allocations;
    if (want > cache_limit_) {
      over_limit(want);
      return Lease(this, alloc_device(want), true);
    }
    drop(c);
    c.p = alloc_device(want);
    c.bytes = want;
    return Lease(this, c.p, false);
  }
  void drop(Cache& c) {
    if (c.p) free_device(c.p);
    c.p = nullptr;
    c.bytes = 0;
  }
  // Says once per mover that a request is above the cache limit: it is allocated and freed per call
  // (stream-ordered on a GPU: cudaMallocAsync/cudaFreeAsync, no device-wide cudaFree).
  void over_limit(size_t bytes) {
    if (uncached_++ == 0)
      std::fprintf(stderr,
                   "pycomm: a working buffer of %zu MiB is above PYCOMM_DEVICE_CACHE_MB=%zu: buffers this large "
                   "are allocated per call (raise the limit to keep them); said once\n",
                   bytes >> 20, cache_limit_ >> 20);
  }
  Cache working_, fusion_, compressed_;
  size_t cache_limit_ = size_t(256) << 20;
  uint64_t uncached_ = 0;
};

// CUDA streams and pinned host memory on `device` (cuda_mover.cu; CUDA builds only).
std::unique_ptr<MemoryMover> make_cuda_mover(int device);

// Whether the MPI library can read and write CUDA device memory itself
// (MPIX_Query_cuda_support where the implementation has it; PYCOMM_CUDA_AWARE
// overrides). Defined in memory_mover.cpp.
bool mpi_is_cuda_aware();
// What the MPI library itself says, whatever PYCOMM_CUDA_AWARE claims: 1 CUDA-aware, 0 built without
// CUDA (Open MPI's mpi-ext.h defines MPIX_CUDA_AWARE_SUPPORT as 0), -1 the library cannot tell.
int mpi_library_cuda_support();
// Why CUDA device pointers may not go to MPI on the direct path ("" when they may): the MPI is not
// CUDA-aware (`forced_direct`: force_device_direct chose the path), or PYCOMM_CUDA_AWARE=1
// (`env_override`) claims so for a library whose headers say it was built without CUDA.
// `what` names the operation. The engine raises it on every rank before any data moves.
std::string direct_path_refusal(const std::string& what, bool cuda_aware, bool forced_direct, int library_support,
                                const char* env_override);

}  // namespace comm
}  // namespace pycomm
