// The peer path: an allreduce of device memory inside a node without a
// CUDA-aware MPI. Every local rank keeps one block that its peers have mapped
// (CUDA IPC on a GPU, peer_memory.h), and the node's reduction runs by peer
// reads on the device, ordered by interprocess signals and two host barriers
// per call; MPI carries only the barriers' few bytes, and, across nodes, the
// node's shards (staged through host memory). The schedule and its bytes:
// peer_allreduce.cpp.
#pragma once
#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "peer_memory.h"

namespace pycomm {
namespace comm {

class MemoryMover;
struct StagingBuffers;

class PeerAllreduce {
 public:
  // Collective over `topo.world`: every local rank exports a block and its signals and opens every
  // peer's, and all ranks agree whether all of that worked. Returns null when it did not anywhere,
  // with the first failing rank's reason in *why. `device` is the memory's CUDA device (-1: the
  // host stand-in).
  static std::unique_ptr<PeerAllreduce> probe(std::unique_ptr<PeerMemory> memory, int device, const Topology& topo,
                                              std::string* why);
  ~PeerAllreduce();  // collective over the node unless a rank has failed (fault.h)
  PeerAllreduce(const PeerAllreduce&) = delete;
  PeerAllreduce& operator=(const PeerAllreduce&) = delete;

  int device() const { return device_; }
  const char* kind() const { return memory_->kind(); }
  size_t block_bytes() const { return 2 * half_; }
  uint64_t allocations() const { return allocations_; }  // collective block (re)allocations, the probe's included

  // out = reduce(in) over every rank, in place when out == in. `device` is the buffer's memory (-1:
  // host): every rank must run on the device it was probed on, else every rank raises CommError.
  // Passes of at most `pass_bytes` (the same on every rank: an agreed option); the block's halves
  // grow to fit them. Across nodes the node's shards go through `staging` over `topo.cross`, by the ring.
  void run(const Buffer& in, const Buffer& out, ReduceOp op, const AverageRule& avg, int device, size_t pass_bytes,
           MemoryMover& mover, StagingBuffers& staging, size_t staging_chunk_bytes, size_t ring_chunk_bytes);

 private:
  PeerAllreduce(std::unique_ptr<PeerMemory> memory, int device, const Topology& topo);
  // Collective over the world (every rank calls it at the same call): this rank's block of two halves
  // of `half` bytes, the old one released, exported, and the peers' opened (with their signals, the
  // first time). CommError on every rank where any of it failed anywhere.
  void exchange_blocks(size_t half, bool with_signals);
  void close_blocks();
  void close_signals();
  // One pass over elements [off, off + n) through block half `h`.
  void pass(const Buffer& in, const Buffer& out, size_t off, size_t n, int h, ReduceOp op, const AverageRule& avg,
            MemoryMover& mover, StagingBuffers& staging, size_t staging_chunk_bytes, size_t ring_chunk_bytes);
  char* block(int rank, int h) const { return blocks_[static_cast<size_t>(rank)] + static_cast<size_t>(h) * half_; }

  std::unique_ptr<PeerMemory> memory_;
  const int device_;
  const Topology& topo_;
  size_t half_ = 0;
  std::vector<char*> blocks_;  // by local rank: this rank's own, and the peers' as mapped here
  std::vector<void*> signals_;  // by local rank * kSignals + k: the peers' as opened here (own: null)
  int next_half_ = 0;
  uint64_t allocations_ = 0;
};

}  // namespace comm
}  // namespace pycomm
