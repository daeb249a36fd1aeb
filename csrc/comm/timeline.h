// The timeline: a Chrome trace (catapult "traceEvents" JSON, opened by
// chrome://tracing or ui.perfetto.dev) of every operation this rank runs.
//
// One file per rank: start(path) on rank r writes `path` with ".rank<r>"
// before its extension (timeline.json -> timeline.rank0.json), with pid = r,
// so the files of a job can be loaded together or concatenated. Each tensor
// name gets a lane (tid, named by a metadata event); per operation it shows
//   QUEUED      submission until the coordination round that runs it starts;
//   <KIND>      the operation itself (ALLREDUCE, BROADCAST, ...; its end event
//               carries "tensors": the fused batch it ran in), containing
//     NEGOTIATE   the coordination round (coordinator.h);
//     PACK / UNPACK, the algorithm (RING_ALLREDUCE, MPI_ALLREDUCE, ...) and
//     its phases (REDUCE_SCATTER, CROSS_NODE, ALLGATHER);
//   DONE        an instant event at completion.
// Phases of a fused batch appear on the lane of every tensor in it.
//
// Off, the cost is one relaxed load of an atomic flag per hook.
#pragma once
#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "coordinator.h"

namespace pycomm {
namespace comm {
namespace timeline {

extern std::atomic<bool> g_on;
inline bool on() { return g_on.load(std::memory_order_relaxed); }

// Start writing to `path` (see above) for rank `rank`; CommError if it cannot be
// opened or a timeline is already running. stop() closes every open range and the file.
void start(const std::string& path, int rank);
void stop();
std::string running_path();  // the file being written, or ""

using Clock = std::chrono::steady_clock;
void begin_phase(const char* name);
void end_phase(const char* name);

// The operations of one coordination round, on the thread that runs them.
// `submitted`: when each was submitted (empty while the timeline is off).
class Batch {
 public:
  Batch(const std::vector<Signature>& proposal, const std::vector<Clock::time_point>& submitted);
  ~Batch();
  // The round decided that the first `count` run now (the rest stay queued
  // and appear in a later round). Writes QUEUED, NEGOTIATE and opens <KIND>.
  void decided(size_t count);
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

 private:
  bool active_ = false;
  const std::vector<Signature>* proposal_ = nullptr;
  std::vector<Clock::time_point> submitted_;
  Clock::time_point start_;
  std::vector<int> lanes_;
  uint64_t generation_ = 0;
};

// A phase of the batch running on this thread; next() ends it and starts another.
class Phase {
 public:
  explicit Phase(const char* name) {
    if (on() && name) begin_phase(name_ = name);
  }
  ~Phase() {
    if (name_) end_phase(name_);
  }
  void next(const char* name) {
    if (name_) end_phase(name_);
    name_ = nullptr;
    if (on() && name) begin_phase(name_ = name);
  }
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  const char* name_ = nullptr;
};

}  // namespace timeline
}  // namespace comm
}  // namespace pycomm
