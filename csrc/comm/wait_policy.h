// How pycomm waits: for a peer in a shared-window barrier (shm_window.cpp) and
// for MPI requests (ring_allreduce.cpp, and through it the hierarchical
// algorithms' cross-node step). Open MPI's MPI_Wait and MPI_Barrier poll
// without giving up the core, so with more ranks than cores (or a CPU-bound
// neighbour process) a waiting rank can hold the core that the rank it waits
// for needs. Every wait loop here polls, and between polls calls
// Waiter::pause(), which escalates:
//
//   1. spin: PYCOMM_WAIT_SPIN polls (default kDefaultSpinPolls), a pause
//      instruction between them; a wait that ends here costs nothing extra;
//   2. yield: sched_yield() until the wait has lasted kYieldMicros; on an idle
//      core it returns at once, so a quiet machine still just polls;
//   3. sleep: futex wait on the barrier's word (woken by the last rank to
//      arrive) or nanosleep, from 2 us doubling to kMaxSleepMicros.
//
// PYCOMM_WAIT_SPIN=0 starts yielding at the first failed poll; -1 never leaves
// the spin phase (the behaviour of plain MPI_Wait). Waiter::pause() is the one
// place every wait loop passes through between polls; past the spin it also
// asks fault.h whether a rank has died (elastic mode), so no wait outlives one.
#pragma once
#include <mpi.h>

#include <atomic>
#include <cstdint>

namespace pycomm {
namespace comm {

constexpr long kDefaultSpinPolls = 200;  // a few to tens of us of polling, depending on what a poll costs
constexpr long kYieldMicros = 200;        // then yield, up to this long into the wait
constexpr long kMaxSleepMicros = 64;      // then sleep, doubling up to this

// PYCOMM_WAIT_SPIN, read once: polls before the first yield; -1 spins for ever.
long wait_spin_polls();

// A 32-bit word in shared memory that a waiter may sleep on (futex): the waiter
// sleeps while *word == unchanged; whoever changes it calls wake_sleepers()
// when *sleepers is nonzero.
struct SleepWord {
  std::atomic<uint32_t>* word = nullptr;
  uint32_t unchanged = 0;
  std::atomic<uint32_t>* sleepers = nullptr;
};

class Waiter {
 public:
  Waiter();
  // One failed poll: spin, yield or sleep per the policy above. `sleep_on`:
  // the word to sleep on in phase 3 instead of a timed nanosleep.
  void pause(const SleepWord* sleep_on = nullptr);

 private:
  long spin_;
  long polls_ = 0;
  int64_t start_ns_ = 0;  // set at the first yield
  long sleep_us_ = 2;
};

// Wake every process sleeping on `word` (process-shared futex).
void wake_sleepers(std::atomic<uint32_t>* word);

// MPI_Wait and MPI_Waitall as MPI_Test / MPI_Testall loops under the policy.
void wait_request(MPI_Request* req);
void wait_requests(int count, MPI_Request* reqs);

}  // namespace comm
}  // namespace pycomm
