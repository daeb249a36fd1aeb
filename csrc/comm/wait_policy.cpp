#include "wait_policy.h"

#include "fault.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>

#include "common.h"

namespace pycomm {
namespace comm {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Shared (not FUTEX_PRIVATE) futexes: the word lives in a window mapped by several processes.
long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex needs a plain 32-bit word");
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

}  // namespace

long wait_spin_polls() {
  static const long polls = [] {
    const char* raw = std::getenv("PYCOMM_WAIT_SPIN");
    if (!raw || !*raw) return kDefaultSpinPolls;
    char* end = nullptr;
    const long v = std::strtol(raw, &end, 10);
    if (*end || v < -1)
      throw CommError(std::string("PYCOMM_WAIT_SPIN must be an integer >= -1 (polls before yielding), got '") + raw +
                      "'");
    return v;
  }();
  return polls;
}

Waiter::Waiter() : spin_(wait_spin_polls()) {}

void Waiter::pause(const SleepWord* sleep_on) {
  if (spin_ < 0 || polls_ < spin_) {
    ++polls_;
    cpu_relax();
    if (spin_ < 0 && polls_ % 4096 == 0) fault::poll();  // spinning for ever still notices a dead rank
    return;
  }
  // Past the spin, a wait may be for a rank that has died: in elastic mode this raises
  // RanksFailedError within fault.h's poll interval instead of waiting for ever (a no-op otherwise).
  fault::poll();
  if (start_ns_ == 0) start_ns_ = now_ns();
  if (now_ns() - start_ns_ < kYieldMicros * 1000) {
    sched_yield();
    return;
  }
  timespec ts{0, sleep_us_ * 1000};
  if (sleep_on && sleep_on->word) {
    // Counted so that the waker only pays for the wake-up syscall when someone sleeps. seq_cst on both
    // sides (here the increment, then the kernel's read of the word; there the word's store, then the
    // count's load): either the waker sees the count or the futex sees the new word and returns at once.
    sleep_on->sleepers->fetch_add(1, std::memory_order_seq_cst);
    futex(sleep_on->word, FUTEX_WAIT, sleep_on->unchanged, &ts);  // the timeout bounds a missed wake-up
    sleep_on->sleepers->fetch_sub(1, std::memory_order_seq_cst);
  } else {
    nanosleep(&ts, nullptr);
  }
  sleep_us_ = std::min(sleep_us_ * 2, kMaxSleepMicros);
}

void wake_sleepers(std::atomic<uint32_t>* word) { futex(word, FUTEX_WAKE, INT_MAX, nullptr); }

void wait_request(MPI_Request* req) {
  if (*req == MPI_REQUEST_NULL) return;
  Waiter waiter;
  for (;;) {
    int done = 0;
    PYCOMM_MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
    if (done) return;
    waiter.pause();
  }
}

void wait_requests(int count, MPI_Request* reqs) {
  if (count <= 0) return;
  Waiter waiter;
  for (;;) {
    int done = 0;
    PYCOMM_MPI_CHECK(MPI_Testall(count, reqs, &done, MPI_STATUSES_IGNORE));
    if (done) return;
    waiter.pause();
  }
}

}  // namespace comm
}  // namespace pycomm
