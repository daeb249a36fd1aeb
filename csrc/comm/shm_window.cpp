#include "shm_window.h"

#include "fault.h"

#include <algorithm>

namespace pycomm {
namespace comm {

void ShmWindow::reserve(size_t bytes) {
  settle();
  if (bytes <= capacity_ && win_ != MPI_WIN_NULL) return;
  // Grow geometrically so a training run settles on one window quickly: a
  // sequence of growing requests reallocates O(log(largest / first)) times.
  // Computed before release(), which forgets the old capacity. Rounded to
  // 4 KiB so each segment starts on its own page.
  // Requests up to the growth limit (the fusion threshold: no fused batch is
  // larger) double at most up to it, so the window settles at the threshold
  // instead of up to twice it.
  size_t doubled = capacity_ * 2;
  if (bytes <= growth_limit_) doubled = std::min(doubled, growth_limit_);
  size_t want = std::max(bytes, doubled);
  want = std::max<size_t>((want + 4095) & ~size_t(4095), 4096);
  release();
  MPI_Info info;
  PYCOMM_MPI_CHECK(MPI_Info_create(&info));
  // Non-contiguous segments let each rank's segment live in its own NUMA domain.
  PYCOMM_MPI_CHECK(MPI_Info_set(info, "alloc_shared_noncontig", "true"));
  void* base = nullptr;
  int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(want), 1, info, comm_, &base, &win_);
  MPI_Info_free(&info);
  PYCOMM_MPI_CHECK(rc);
  segments_.assign(static_cast<size_t>(size_), nullptr);
  for (int r = 0; r < size_; ++r) {
    MPI_Aint seg_size = 0;
    int disp = 0;
    void* ptr = nullptr;
    PYCOMM_MPI_CHECK(MPI_Win_shared_query(win_, r, &seg_size, &disp, &ptr));
    segments_[static_cast<size_t>(r)] = static_cast<char*>(ptr);
  }
  PYCOMM_MPI_CHECK(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_));
  capacity_ = want;
  ++allocations_;
}

void ShmWindow::fence() {
  // The unified-memory idiom for shared windows: sync, barrier, sync.
  PYCOMM_MPI_CHECK(MPI_Win_sync(win_));
  PYCOMM_MPI_CHECK(MPI_Barrier(comm_));
  PYCOMM_MPI_CHECK(MPI_Win_sync(win_));
}

size_t ShmWindow::take_half(size_t bytes) {
  const size_t half = (bytes + 63) & ~size_t(63);  // whole cache lines
  if (win_ == MPI_WIN_NULL || 2 * half > capacity_) {
    reserve(2 * half);  // settles first; the new window has no readers
    half_ = 0;
  }
  const size_t offset = half_ ? capacity_ / 2 : 0;  // capacity_ is a multiple of 4 KiB
  half_ ^= 1;
  reads_pending_ = true;
  return offset;
}

void ShmWindow::release() {
  if (win_ == MPI_WIN_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  // After a rank failed (fault.h) the window is left allocated: freeing it is collective over a node
  // that has lost a member.
  if (!finalized && !fault::failed()) {
    settle();
    MPI_Win_unlock_all(win_);
    MPI_Win_free(&win_);
  }
  win_ = MPI_WIN_NULL;
  capacity_ = 0;
  segments_.clear();
}

}  // namespace comm
}  // namespace pycomm
