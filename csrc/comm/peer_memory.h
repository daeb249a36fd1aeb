// Memory that the other processes of a node can map, and the order between
// them, for the peer path (peer_allreduce.cpp): device memory reduced inside
// the node by peer reads, with no CUDA-aware MPI.
//
//   on a GPU          blocks from cudaMalloc exported as CUDA IPC handles
//                     (cudaIpcGetMemHandle / cudaIpcOpenMemHandle), signals as
//                     interprocess CUDA events; the work runs on the mover's lane 0;
//   host stand-in     blocks are POSIX shared-memory objects (shm_open + mmap),
//                     the handle is the object's name; the work runs on the
//                     calling thread, so a signal needs no event.
//
// A handle travels over MPI as kHandleBytes plain bytes. No MPI or torch here
// (cuda_mover.cu, which implements the CUDA form, compiles with plain nvcc).
#pragma once
#include <cstddef>
#include <memory>

#include "../kernels/dtype.h"

namespace pycomm {
namespace comm {

class PeerMemory {
 public:
  static constexpr size_t kHandleBytes = 64;  // cudaIpcMemHandle_t and cudaIpcEventHandle_t are 64 bytes
  struct Handle {
    char bytes[kHandleBytes] = {};
  };
  // Signals per process: the peer allreduce records one after its copy-in and one after its reduction.
  static constexpr int kSignals = 2;

  virtual ~PeerMemory() = default;
  virtual const char* kind() const = 0;  // "CUDA IPC" or "host shared memory"

  // ---- blocks: this process's, and the peers' it has opened
  // A block of `bytes` that the node's other processes can open by *handle.
  virtual void* export_block(size_t bytes, Handle* handle) = 0;
  // Once every peer has opened the block: drop the name it was opened by, so nothing outlives the
  // processes if one dies (the host stand-in unlinks its object; a no-op for CUDA IPC).
  virtual void unpublish(const Handle& handle) = 0;
  // Free this process's block; every peer has closed it by then.
  virtual void release_block(void* block, size_t bytes) = 0;
  // A peer's block in this process's address space (a device pointer on a GPU); CommError with the
  // reason when it cannot be opened.
  virtual void* open_block(const Handle& handle, size_t bytes) = 0;
  virtual void close_block(void* block, size_t bytes) = 0;

  // ---- order between processes
  // This process's signals; peers open them by their handles.
  virtual void export_signals(Handle handles[kSignals]) = 0;
  virtual void* open_signal(const Handle& handle) = 0;
  virtual void close_signal(void* signal) = 0;
  // Record signal k after the work issued so far.
  virtual void signal(int k) = 0;
  // What runs next waits (on the device, not the host) for the peer's latest record of `opened`.
  // Recording and waiting must be separated by a host barrier, so that the wait sees the record.
  virtual void wait_signal(void* opened) = 0;

  // ---- work, in issue order (lane 0 of the mover on a GPU; the calling thread on the host)
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // either side may be a peer's block
  virtual void reduce(void* dst, const void* src, size_t count, kernels::DType dtype, kernels::ReduceOp op) = 0;
  virtual void scale(void* dst, size_t count, kernels::DType dtype, double factor) = 0;
  // The host waits for the work issued so far (before handing memory to MPI, or releasing a block).
  virtual void synchronize() = 0;
};

// The host stand-in (peer_memory.cpp).
std::unique_ptr<PeerMemory> make_host_peer_memory();

}  // namespace comm
}  // namespace pycomm
