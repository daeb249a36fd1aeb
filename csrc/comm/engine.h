// The collective engine: one background thread that runs every collective in
// submission order on the job's private communicators. Callers get a Work
// handle; the synchronous API is submit + wait.
#pragma once
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {

enum class Algorithm : int32_t { AUTO = 0, RING = 1, MPI = 2 };
const char* algorithm_name(Algorithm a);

struct EngineOptions {
  size_t ring_chunk_bytes = size_t(1) << 19;  // 512 KiB pipeline chunks
  size_t auto_ring_min_bytes = size_t(1) << 16;  // below this "auto" uses MPI_Allreduce
  bool check_consistency = true;  // exchange a signature before each collective
};

// Completion of one submitted operation. `keepalive` holds whatever the
// caller needs alive until the operation ends (the bindings put tensors there).
class Work {
 public:
  explicit Work(std::string description, std::shared_ptr<void> keepalive)
      : description_(std::move(description)), keepalive_(std::move(keepalive)) {}
  void wait();  // blocks until done; rethrows the operation's error
  bool done() const;
  const std::string& description() const { return description_; }
  void finish(std::exception_ptr error);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::string description_;
  std::shared_ptr<void> keepalive_;
};

using WorkPtr = std::shared_ptr<Work>;

struct AllreduceArgs {
  Buffer input;
  Buffer output;  // == input for in-place
  ReduceOp op = ReduceOp::SUM;
  bool average = false;
  Algorithm algorithm = Algorithm::AUTO;
  std::string name;
};

class Engine {
 public:
  Engine(const Topology& topo, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const Topology& topology() const { return topo_; }
  EngineOptions options() const;
  void set_options(const EngineOptions& options);

  // `blocking`: the caller will wait at once, so run on its thread if the engine is idle.
  WorkPtr allreduce(const AllreduceArgs& args, std::shared_ptr<void> keepalive, bool blocking = false);
  WorkPtr compressed_allreduce(const struct CompressedArgs& args, std::shared_ptr<void> keepalive, bool blocking = false);  // compressed_allreduce.h
  WorkPtr broadcast(const Buffer& buf, int root, std::string name, std::shared_ptr<void> keepalive,
                    bool blocking = false);
  // `send` holds `rows` rows of shape `row_shape`; `allocate(total_rows)` runs on
  // the engine thread and returns the output memory.
  WorkPtr allgather(const Buffer& send, size_t rows, std::vector<int64_t> row_shape,
                    std::function<void*(size_t)> allocate, std::string name, std::shared_ptr<void> keepalive);
  WorkPtr barrier(bool blocking = false);

  // Number of operations run so far (for tests and stall reports).
  uint64_t completed() const;

 private:
  // Queue `body` for the worker; with `inline_if_idle` and nothing queued or
  // running, run it on the calling thread instead (a synchronous call then
  // costs no thread hand-off, which on a busy machine is a scheduler slice).
  WorkPtr submit(std::string description, std::shared_ptr<void> keepalive, std::function<void()> body,
                 bool inline_if_idle = false);
  void run_item(const WorkPtr& work, const std::function<void()>& body);
  void loop();
  void run_allreduce(const AllreduceArgs& args);

  Topology topo_;
  EngineOptions options_;
  EngineOptions active_;  // the worker's copy, refreshed before each operation
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<WorkPtr, std::function<void()>>> queue_;
  bool stopping_ = false;
  bool busy_ = false;  // an operation is running (on the worker or inline on a caller)
  uint64_t completed_ = 0;
  std::thread worker_;
};

}  // namespace comm
}  // namespace pycomm
