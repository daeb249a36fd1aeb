// The collective engine: one background worker that runs every collective in
// submission order on the job's private communicators. Callers get a Work
// handle; a blocking call on an idle engine runs on the caller's thread.
//
// Each operation starts with a coordination round (coordinator.h): the ranks
// agree on what runs next, which catches ranks that disagree and reports
// stalls. Consecutive compatible allreduces waiting in the queue are fused
// (tensor fusion): packed into one buffer up to `fusion_threshold_bytes`,
// reduced by one allreduce, unpacked. The coordinator makes every rank fuse
// the same tensors in the same order.
//
// The Engine decides what runs and when: the queue, the coordination rounds,
// the batches, join (engine_join.cpp) and backup sessions. Its Executor
// (executor.h) runs what was agreed: the memory path, the algorithm, the fused
// buffer, and the memory they reuse.
#pragma once
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "allreduce_catalogue.h"
#include "common.h"
#include "coordinator.h"
#include "device_event.h"
#include "executor.h"
#include "operations.h"

namespace pycomm {
namespace comm {

class BackupSession;

// Completion of one submitted operation. `keepalive` holds whatever the
// caller needs alive until the operation ends (the bindings put tensors there).
class Work {
 public:
  // `kind` (a string literal: "allreduce", "barrier") and the operation's name, joined only when the
  // description is asked for (a stall report, a handle's repr): a submission builds no string of its
  // own (bench/submit_instructions.py).
  Work(const char* kind, std::string name, std::shared_ptr<void> keepalive)
      : kind_(kind), name_(std::move(name)), keepalive_(std::move(keepalive)) {}
  void wait();  // blocks until done; rethrows the operation's error
  bool done() const;
  std::string description() const { return name_.empty() ? kind_ : kind_ + (" " + name_); }
  void finish(std::exception_ptr error);
  // Finish the works of one batch: all are marked done first, then woken, then their keepalives
  // dropped and callbacks run. A caller waiting on them one by one finds the rest done instead of
  // being woken once per work while the engine marks them (400 fused works: 1.3 us a wait -> 0.4).
  // For batches of several works; one work takes finish().
  static void finish_all(Work* const* works, size_t count, std::exception_ptr error);
  // Run `fn(error)` once the operation has finished: on the finishing thread,
  // or at once on the caller's if it already has (the c10d backend completes
  // its futures this way).
  void then(std::function<void(std::exception_ptr)> fn);
  // Stream order (device_event.h). `ready`: recorded on the submitter's stream, waited on by the
  // engine before it touches the memory. `done_event`: recorded by the engine after its device work,
  // set before finish() (so visible to whoever wait() released); null for host memory.
  EventPtr ready;
  EventPtr done_event() const {
    std::lock_guard<std::mutex> lock(mu_);
    return done_event_;
  }
  void set_done_event(EventPtr e) {
    std::lock_guard<std::mutex> lock(mu_);
    done_event_ = std::move(e);
  }

 private:
  EventPtr done_event_;
  std::vector<std::function<void(std::exception_ptr)>> callbacks_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  const char* kind_;
  std::string name_;
  std::shared_ptr<void> keepalive_;
};

using WorkPtr = std::shared_ptr<Work>;

class Engine {
 public:
  Engine(const Topology& topo, MPI_Comm control, bool homogeneous, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const Topology& topology() const { return topo_; }
  EngineOptions options() const;
  // Collective: queued behind the operations already submitted and applied at
  // that same point on every rank; the ranks must pass the same options
  // (CommError on every rank otherwise). Blocks until applied.
  void set_options(const EngineOptions& options);

  // What a submitter may hold that the engine thread can need while it holds the queue's lock (the
  // binding's: Python's GIL, which dropping the last reference to a tensor takes). A submission
  // given one takes the queue's lock at once when it is free, keeping what it holds; only when the
  // lock is busy does it call release() first and then wait. Releasing and taking the GIL again
  // cost a small asynchronous allreduce about 370 of its 5,500 instructions (bench/submit_instructions.py).
  struct SubmitterHold {
    virtual void release() = 0;

   protected:
    ~SubmitterHold() = default;
  };
  // `blocking`: the caller waits at once, so run on its thread if the engine is idle. `held`: only
  // with blocking false (a blocking call may run the collective on the caller's thread).
  WorkPtr allreduce(AllreduceArgs&& args, std::shared_ptr<void> keepalive, bool blocking = false,
                    SubmitterHold* held = nullptr);
  // pycomm.grouped_allreduce: allreduces queued together, in list order, in one submission (one
  // lock, at most one worker wake-up), sharing `keepalive`; they fuse as consecutive allreduces do.
  // `blocking`: the caller waits at once, so they run without waiting out the fusion cycle.
  std::vector<WorkPtr> allreduce_group(const std::vector<AllreduceArgs>& args, std::shared_ptr<void> keepalive,
                                       bool blocking = false);
  WorkPtr compressed_allreduce(const struct CompressedArgs& args, std::shared_ptr<void> keepalive, bool blocking = false);  // compressed_allreduce.h
  WorkPtr broadcast(const Buffer& buf, int root, std::string name, std::shared_ptr<void> keepalive,
                    bool blocking = false);
  // `send` holds `rows` rows of shape `row_shape`; `allocate(total_rows)` runs on
  // the engine thread and returns the output memory.
  WorkPtr allgather(const Buffer& send, size_t rows, std::vector<int64_t> row_shape,
                    std::function<void*(size_t)> allocate, std::string name, std::shared_ptr<void> keepalive);
  WorkPtr barrier(bool blocking = false);
  // pycomm.join() (engine_join.cpp): this rank has no more work; until every
  // rank has joined it answers the others' allreduces (with the reduction's
  // identity: zeros for sum/avg, counted out of the average), broadcasts,
  // allgathers (no rows) and barriers. Sets `*last_rank` to the rank that
  // joined last. Blocks until every rank has joined. `answer_gathers` false (Horovod's join): while
  // this rank is joined, the others' allgathers and broadcasts raise CommError on the ranks that
  // made them, and this rank stays joined.
  WorkPtr join(std::shared_ptr<int> last_rank, bool blocking = true, bool answer_gathers = true);
  // A backup-worker session (backup_allreduce.h/.cpp): queued like any operation, agreed by one
  // coordination round, then it runs until every rank has closed it. The Work ends with it.
  WorkPtr backup_session(std::shared_ptr<BackupSession> session);
  // A caller waits for queued work: stop holding allreduces back for fusion
  // partners (the cycle time) and run what is queued now.
  void flush();
  // A caller about to block in work.wait(): while `work` is not done and the queue's head is a batch
  // of allreduces that the worker has not taken yet (it is idle, or holding the head back for its
  // fusion cycle or pair_by_name's), run that batch here, on the caller's thread, as a blocking call
  // on an idle engine does; otherwise flush(). The worker is not woken to run it and the caller is
  // not woken after it: two thread hand-offs fewer for the first wait of a step
  // (bench/submit_cost.py, its first-wait column). Call without Python's GIL (the batch may run here).
  void run_queued_for(const Work& work);
  WorkPtr reduce_scatter(const ReduceScatterArgs& args, std::shared_ptr<void> keepalive, bool blocking = false);
  WorkPtr alltoall(const AlltoallArgs& args, std::shared_ptr<void> keepalive, bool blocking = false);

  using Stats = EngineStats;  // operations.h
  Stats stats() const;

  // Run `fn` on the engine thread as one operation (for algorithms defined
  // elsewhere, e.g. compressed allreduce). `sig` is what the ranks agree on; `kind` and `name`
  // describe it (Work).
  WorkPtr submit_custom(const Signature& sig, const char* kind, std::string name, std::shared_ptr<void> keepalive,
                        std::function<void()> fn, bool blocking);

  // force_staging, force_device_direct or force_peer: host memory stands in for device memory.
  bool device_standin() const {
    std::lock_guard<std::mutex> lock(mu_);
    return options_.force_staging || options_.force_device_direct || options_.force_peer;
  }
  // The data side: paths, algorithms and memory (executor.h).
  Executor& executor() { return *exec_; }

 private:
  struct Op {
    WorkPtr work;
    Signature sig;
    std::function<void()> body;  // non-fusable operations
    bool fusable = false;        // an allreduce that may share a fused buffer
    AllreduceArgs allreduce;
    std::chrono::steady_clock::time_point submitted;
  };

  // Ops and their arguments pass by reference down the submission path: each is moved once, into the queue.
  WorkPtr enqueue(Op&& op, bool inline_if_idle, SubmitterHold* held = nullptr);
  // pair_by_name: flag a named data operation to pair by name (with mu_ held: reads options_).
  void mark_by_name(Op& op) const;
  Op allreduce_op(AllreduceArgs&& args, std::shared_ptr<void> keepalive);
  void loop();
  // With mu_ held, by whichever thread holds busy_ (the worker, or a waiter in run_queued_for): the
  // batch at the queue's head under the fusion rule (take_batch, engine.cpp), appended to *batch (null:
  // only look); returns whether it could still grow. end_batch: pops the `popped` operations execute()
  // took from the head and gives busy_ back.
  bool head_batch(std::vector<Op*>* batch);
  void end_batch(size_t popped);
  // Coordinate and run `batch` (taken from the queue head); returns how many ran.
  size_t execute(std::vector<Op*>& batch);
  // The first `count` ops of `batch`, fused (Executor::fused_allreduce).
  void run_fused(const std::vector<Op*>& batch, size_t count);
  void await_ready(const std::vector<Op*>& batch, size_t count);
  void record_done(const std::vector<Op*>& batch, size_t count);
  // engine_join.cpp: the join loop, a joined rank's answer to the others'
  // batch, and a batch run while `joined` ranks contribute nothing.
  size_t execute_join(std::vector<Op*>& batch);
  void answer_joined(const std::vector<Signature>& ops);
  void run_with_joined(std::vector<Op*>& batch, size_t count, int joined);
  int join_last_ = -1;
  // backup_allreduce.cpp: the session's loop on the engine thread.
  void run_backup_session(BackupSession& session);
  std::vector<char> join_scratch_;
  bool compatible(const Op& head, const Op& next) const;

  Topology topo_;
  EngineOptions options_;
  EngineOptions active_;  // the running operation's copy (the executor reads it)
  Coordinator coordinator_;
  std::unique_ptr<Executor> exec_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  // pair_by_name: operations set aside until every rank has submitted their names. Changed by the
  // executing thread only (the one holding busy_), under mu_.
  std::deque<Op> parked_;
  // When a rank holding parked operations, with nothing queued, proposes them again (a round
  // that ran nothing asks it to wait for a submission or this moment, whichever comes first).
  std::chrono::steady_clock::time_point parked_retry_at_{};
  bool parked_due() const { return !parked_.empty() && std::chrono::steady_clock::now() >= parked_retry_at_; }
  bool stopping_ = false;
  bool busy_ = false;  // an operation is running (on the worker or inline on a caller)
  bool flush_ = false;  // flush(): skip the rest of the fusion cycle
  // The worker holds the queue's head back for its fusion cycle: busy_ is set but no batch is taken,
  // so a waiter may take the batch over (run_queued_for), counted in takeovers_.
  bool gathering_ = false;
  uint64_t takeovers_ = 0;
  size_t running_ = 0;  // ops at the queue's head that the worker is executing (they are not "held back")
  Stats stats_;
  std::string last_op_ = "none yet";  // for stall reports; empty: last_sig_ (and last_count_ - 1 fused)
  Signature last_sig_;
  size_t last_count_ = 0;
  std::chrono::steady_clock::time_point idle_since_ = std::chrono::steady_clock::now();
  std::string status() const;  // what this rank's engine is doing, for the coordinator's stall query
  std::thread worker_;
};

}  // namespace comm
}  // namespace pycomm
