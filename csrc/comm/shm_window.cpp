#include "shm_window.h"

#include "fault.h"

#include <algorithm>
#include <atomic>
#include <new>

#include "wait_policy.h"

namespace pycomm {
namespace comm {

// The fence's barrier, in the first page of local rank 0's segment (each
// segment is allocated kControlBytes longer; segment() points past it). Each
// word on its own cache line, so arrivals do not disturb the waiters' polls.
struct ShmWindow::Control {
  alignas(64) std::atomic<uint32_t> arrived{0};   // ranks in the current fence
  alignas(64) std::atomic<uint32_t> epoch{0};     // fences completed; waiters poll (or sleep on) it
  alignas(64) std::atomic<uint32_t> sleepers{0};  // waiters inside a futex wait (wait_policy.cpp)
};

namespace {
constexpr size_t kControlBytes = 4096;  // one page: the data segments stay page-aligned
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
              "the barrier's words are plain lock-free 32-bit words shared between processes");
}  // namespace

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
  int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(want + kControlBytes), 1, info, comm_, &base, &win_);
  MPI_Info_free(&info);
  PYCOMM_MPI_CHECK(rc);
  segments_.assign(static_cast<size_t>(size_), nullptr);
  for (int r = 0; r < size_; ++r) {
    MPI_Aint seg_size = 0;
    int disp = 0;
    void* ptr = nullptr;
    PYCOMM_MPI_CHECK(MPI_Win_shared_query(win_, r, &seg_size, &disp, &ptr));
    segments_[static_cast<size_t>(r)] = static_cast<char*>(ptr) + kControlBytes;
  }
  PYCOMM_MPI_CHECK(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_));
  // Loads and stores on the window are plain memory accesses only in the unified model; in the
  // separate model (no known shared-memory implementation) the fence stays MPI_Win_sync + MPI_Barrier.
  int* model = nullptr;
  int has_model = 0;
  PYCOMM_MPI_CHECK(MPI_Win_get_attr(win_, MPI_WIN_MODEL, &model, &has_model));
  if (has_model && *model == MPI_WIN_UNIFIED) {
    char* page = segments_[0] - kControlBytes;
    if (rank_ == 0) control_ = new (page) Control();
    else control_ = reinterpret_cast<Control*>(page);
    PYCOMM_MPI_CHECK(MPI_Barrier(comm_));  // nobody uses the words before rank 0 has zeroed them
  }
  fences_ = 0;
  capacity_ = want;
  ++allocations_;
}

void ShmWindow::fence() {
  if (!control_) {
    // The unified-memory idiom for shared windows: sync, barrier, sync.
    if (win_ != MPI_WIN_NULL) PYCOMM_MPI_CHECK(MPI_Win_sync(win_));
    PYCOMM_MPI_CHECK(MPI_Barrier(comm_));
    if (win_ != MPI_WIN_NULL) PYCOMM_MPI_CHECK(MPI_Win_sync(win_));
    return;
  }
  // Epoch barrier. Every rank passes the same fences in the same order, so fence k waits for epoch
  // k+1. Ordering: each arrival's fetch_add releases the rank's stores to the window; the fetch_adds
  // form one release sequence, so the last arrival's fetch_add acquires all of them, and its store of
  // the new epoch releases them to every waiter's acquiring load. arrived is reset before that store,
  // so no rank can enter the next fence and see a stale count.
  Control& c = *control_;
  const uint32_t epoch = fences_++;
  if (c.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(size_)) {
    c.arrived.store(0, std::memory_order_relaxed);
    c.epoch.store(epoch + 1, std::memory_order_seq_cst);
    if (c.sleepers.load(std::memory_order_seq_cst) != 0) wake_sleepers(&c.epoch);
    return;
  }
  const SleepWord word{&c.epoch, epoch, &c.sleepers};
  Waiter waiter;
  while (c.epoch.load(std::memory_order_acquire) == epoch) waiter.pause(&word);
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
  control_ = nullptr;
  capacity_ = 0;
  segments_.clear();
}

}  // namespace comm
}  // namespace pycomm
