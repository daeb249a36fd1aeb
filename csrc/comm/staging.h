// Moving device memory through host staging buffers, written once for any
// kind of memory.
//
// With an MPI that cannot read device memory, an allreduce of device data is
// cut into chunks that travel device -> pinned host buffer -> host allreduce
// -> device, double-buffered: while chunk k is reduced across ranks on the
// host, chunk k+1 is being copied down and chunk k-1 copied back up.
//
// A MemoryMover says how bytes move between the buffer's memory and host
// staging memory. Copies are asynchronous and ordered per lane (a CUDA stream
// on GPUs); the pipeline uses lane k % 2 for chunk k.
#pragma once
#include <cstddef>
#include <functional>

#include "common.h"
#include "memory_mover.h"

namespace pycomm {
namespace comm {

// Two reusable host chunk buffers from one mover.
struct StagingBuffers {
  void* chunk[2] = {nullptr, nullptr};
  size_t bytes = 0;
  MemoryMover* owner = nullptr;
  void reserve(MemoryMover& mover, size_t bytes);
  void release();
  ~StagingBuffers() { release(); }
};

// Double-buffered staging of `src` (in the mover's memory) through host
// chunks of at most `chunk_bytes` into `dst` (same shape, may equal src);
// `host_allreduce` reduces one host chunk across ranks in place. Every rank
// cuts the buffer into the same chunks. The host waits per chunk, for the
// download MPI reads next (and the upload whose buffer it reuses); at the end
// it waits for the last uploads only if `host_wait` (a caller that reads dst
// on another stream or on the host), else they are ordered before lane 0's
// next work and record_done() (MemoryMover::join_lanes).
void staged_allreduce(const Buffer& src, const Buffer& dst, MemoryMover& mover, StagingBuffers& staging,
                      size_t chunk_bytes, const std::function<void(const Buffer& host_chunk)>& host_allreduce,
                      bool host_wait = true);

}  // namespace comm
}  // namespace pycomm
