// The stage clock: where an algorithm's time goes, for bench/allreduce.py --stages.
//
// An algorithm splits its run into stages and marks each stage's end:
//   COPY_IN   the tensor into the shared window (or the fused buffer);
//   REDUCE    the reduction kernel, summing a peer's data into one's own;
//   COPY_OUT  the reduced data back into the tensor;
//   BARRIER   waiting in a shared-window fence for the node's other ranks;
//   MPI       inside MPI: the transport's own copies and waiting for the peer.
// While the clock runs, each mark adds the time since the previous mark (or the
// StageClock's construction) to its stage's total, with the bytes the stage
// moved: for a copy twice the bytes copied (read once, written once; a fused
// batch's pre-division is counted in its copy's time, not its bytes), for a
// reduction of n bytes into one's own 3n (both read, one written), for MPI the
// bytes sent + received, none for BARRIER. The totals are the process's (every
// thread adds to them); take() reads and clears them. On device memory a stage
// lasts until the host's call returns, which may be before the device is done.
//
// Off, a StageClock costs one relaxed load when it is made and a branch a mark.
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace pycomm {
namespace comm {
namespace stage_clock {

enum Stage : int { kCopyIn, kReduce, kCopyOut, kBarrier, kMpi, kStageCount };
const char* stage_name(Stage s);  // "copy_in", "reduce", ...

extern std::atomic<bool> g_running;
inline bool running() { return g_running.load(std::memory_order_relaxed); }
void set_running(bool on);

struct StageTotals {
  std::array<uint64_t, kStageCount> nanoseconds{};
  std::array<uint64_t, kStageCount> bytes{};
  std::array<uint64_t, kStageCount> marks{};
};
StageTotals take();  // the totals since the last take(), then zero

// The bytes a stage is credited with (see above): a copy of n bytes, and a reduction of n bytes
// into one's own buffer from each of `peers` others.
inline uint64_t copy_bytes(size_t n) { return 2 * static_cast<uint64_t>(n); }
inline uint64_t reduction_bytes(size_t n, int peers = 1) { return 3 * static_cast<uint64_t>(peers) * n; }
void add(Stage s, uint64_t nanoseconds, uint64_t bytes);

class StageClock {
 public:
  StageClock() : on_(running()) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  // The stage that began at the previous mark ends now, as `s`, having moved `bytes`.
  void mark(Stage s, uint64_t bytes = 0) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    add(s, static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count()), bytes);
    last_ = now;
  }
  // The time since the previous mark was counted elsewhere (an inner algorithm's own clock).
  void skip() {
    if (on_) last_ = std::chrono::steady_clock::now();
  }

 private:
  bool on_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace stage_clock
}  // namespace comm
}  // namespace pycomm
