// Synchronous SGD with backup workers (Chen et al. 2016; docs/algorithms.md §4): a session of
// gradient averages in which each step counts the first N = size - B gradients to arrive and drops
// the other B. The schedule, the messages and their bytes are in backup_allreduce.cpp.
//
// A BackupSession is shared between the Python thread (submit / take / close) and the engine
// thread, which runs the session as one long engine operation (Engine::backup_session) from the
// moment every rank has opened it until every rank has closed it. While it runs, the engine runs
// nothing else: an operation submitted behind it on any rank ends the session with a CommError on
// every rank.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {

class BackupSession {
 public:
  // `numel` float32 elements per gradient, `backups` = B, steps numbered from `first_step`;
  // every rank passes the same values (the opening round compares them).
  BackupSession(size_t numel, int backups, int64_t first_step, std::string name);

  size_t numel() const { return numel_; }
  int backups() const { return backups_; }
  int64_t first_step() const { return first_step_; }
  const std::string& name() const { return name_; }

  // ---- the Python thread ----
  // Whether the average of `step` is in (decided and reduced; this rank may not have submitted).
  bool ready(int64_t step);
  // Hand in this rank's gradient for `step` (copied). False: the step was already decided
  // without it (the gradient is dropped). Throws CommError if the session has ended, and for a
  // step other than the next one this rank has not taken.
  bool submit(const float* grad, int64_t step);
  // Wait until the average of `step` is in; copy it to `out` (numel floats) and the ranks it
  // counted (ascending) to `counted`. Returns whether this rank's gradient counted. Steps are
  // taken in order. Throws the session's error.
  bool take(int64_t step, float* out, std::vector<int>* counted);
  // This rank takes no more steps; it has taken `steps_taken` (= the step after its last).
  // The engine then ends the session once every rank has closed with the same count.
  void close(int64_t steps_taken);

  // ---- the engine thread (backup_allreduce.cpp) ----
  // The session runs: from now on a rank other than 0 announces a gradient to rank 0 from the
  // submitting thread itself (MPI is initialized with THREAD_MULTIPLE), without waiting for the
  // engine thread's next poll. `session`: the id every message carries.
  void start(MPI_Comm control, int rank, int64_t session);
  // Whether the engine thread must announce the gradient of `step` (handed in before the session
  // ran, so not announced by submit()); marks it announced.
  bool take_announcement(int64_t step);
  struct Step {
    int64_t step = 0;
    std::vector<int> counted;
    bool mine = false;  // this rank's gradient counted
    std::vector<float> average;
  };
  // The gradient of the next undecided step, if the Python thread has handed it in: copies it
  // to `dst`. `*close_count` is set (>= 0) once this rank has closed.
  bool local_gradient(int64_t step, float* dst, int64_t* close_count);
  bool has_gradient(int64_t step, int64_t* close_count);
  void push(Step s);                    // a decided step's average; next step = s.step + 1
  void end(std::exception_ptr error);   // the session is over (error: why)
  bool ended();

 private:
  void throw_if_ended_locked();

  const size_t numel_;
  const int backups_;
  const int64_t first_step_;
  const std::string name_;

  std::mutex mu_;
  std::condition_variable cv_;
  int64_t next_step_;        // the engine's next undecided step
  int64_t taken_;            // the next step the Python thread takes
  int64_t slot_step_ = -1;   // the step of the gradient in `slot_`, or -1
  std::vector<float> slot_;
  int64_t close_count_ = -1;
  MPI_Comm control_ = MPI_COMM_NULL;  // set by start()
  int rank_ = -1;
  int64_t session_ = -1;
  int64_t announced_ = -1;  // the last step whose READY went to rank 0
  std::deque<Step> results_;  // decided, not yet taken
  bool ended_ = false;
  std::exception_ptr error_;
};

}  // namespace comm
}  // namespace pycomm
