// Node-local shared memory through an MPI-3 shared window
// (MPI_Win_allocate_shared on the node communicator). Every rank of the node
// owns one segment and can load/store every other rank's segment directly,
// so intra-node reductions read the peers' data in place instead of copying
// it through MPI messages.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {

class ShmWindow {
 public:
  explicit ShmWindow(MPI_Comm local) : comm_(local) {
    PYCOMM_MPI_CHECK(MPI_Comm_rank(local, &rank_));
    PYCOMM_MPI_CHECK(MPI_Comm_size(local, &size_));
  }
  ~ShmWindow() { release(); }
  ShmWindow(const ShmWindow&) = delete;
  ShmWindow& operator=(const ShmWindow&) = delete;

  // Collective over the node: make every segment at least `bytes` long.
  // All ranks of the node must ask for the same size (the engine's agreement
  // check guarantees it).
  void reserve(size_t bytes);

  // Growth of requests up to `bytes` stops there (see reserve); 0: plain doubling.
  void set_growth_limit(size_t bytes) { growth_limit_ = bytes; }

  char* segment(int local_rank) const { return segments_[static_cast<size_t>(local_rank)]; }
  char* mine() const { return segment(rank_); }
  size_t capacity() const { return capacity_; }  // bytes per segment; the window holds size() of them
  uint64_t allocations() const { return allocations_; }  // collective (re)allocations so far
  int rank() const { return rank_; }
  int size() const { return size_; }

  // Make every rank's stores visible to the node, and wait for all ranks: a
  // counter barrier in the window's control page (shm_window.cpp), waiting
  // under wait_policy.h.
  void fence();

  // Small messages (shm_allreduce's one-fence form): the offset in every
  // segment of the half that this call uses for `bytes`. Consecutive calls
  // alternate halves, so a call never overwrites what a peer may still read
  // from the previous one (the fence of the call in between separates them);
  // anything else that writes the window first settles (reserve()).
  size_t take_half(size_t bytes);
  // After a one-fence call peers may still read this rank's segment: fence
  // before reusing it in any other way. Called by reserve(); a no-op otherwise.
  void settle() {
    if (reads_pending_) {
      fence();
      reads_pending_ = false;
    }
  }

 private:
  void release();
  struct Control;

  MPI_Comm comm_;
  MPI_Win win_ = MPI_WIN_NULL;
  int rank_ = 0, size_ = 1;
  size_t capacity_ = 0;
  uint64_t allocations_ = 0;
  size_t growth_limit_ = 0;
  std::vector<char*> segments_;
  bool reads_pending_ = false;  // a one-fence call has not been followed by a fence yet
  int half_ = 0;                // the half the next take_half() uses
  Control* control_ = nullptr;  // the barrier's words, in local rank 0's control page; null: MPI_Barrier
  uint32_t fences_ = 0;         // fences this rank has passed in this window (the barrier's epoch)
};

}  // namespace comm
}  // namespace pycomm
