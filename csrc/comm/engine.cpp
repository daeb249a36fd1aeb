#include "engine.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "../kernels/reduce.h"
#include "compressed_allreduce.h"
#include "memory_mover.h"
#include "mpi_types.h"
#include "timeline.h"

namespace pycomm {
namespace comm {

// Tensors per fused batch: bounds the coordination message (1024 signatures of 136 bytes). 400 small
// tensors (bench/fusion.py) went in 4 rounds at 128, each a point where a rank of a loaded machine
// can lose its core for milliseconds; one round now.
constexpr size_t kMaxFusedOps = 1024;

namespace {
// The batch rule, for the worker's queue and for a blocking group run inline: the
// head, then the compatible allreduces after it, up to the fusion threshold in bytes
// and kMaxFusedOps tensors (one, without fusion). Appends them to *batch, or with
// batch null only looks. Returns whether the batch could still grow, i.e. all of
// [first, last) joined and neither limit is reached: what the head waits for
// during its fusion cycle.
// Whether a batch headed by `head` fuses: fusion on, and an allreduce under the threshold.
template <class Op>
bool fuses(const EngineOptions& o, const Op& head) {
  return o.fusion_threshold_bytes > 0 && o.cycle_time_ms > 0 && head.fusable &&
         head.allreduce.input.bytes() <= o.fusion_threshold_bytes;
}

template <class It, class Compatible, class Batch>
bool take_batch(It first, It last, bool fusion, size_t threshold, const Compatible& compatible, Batch* batch) {
  size_t bytes = 0, n = 0;
  for (It it = first; it != last; ++it) {
    if (n == (fusion ? kMaxFusedOps : 1)) return false;
    if (it != first && !(fusion && compatible(*first, *it))) return false;
    const size_t b = it->fusable ? it->allreduce.input.bytes() : 0;
    if (it != first && bytes + b > threshold) return false;
    bytes += b;
    ++n;
    if (batch) batch->push_back(&*it);
  }
  return fusion && bytes < threshold && n < kMaxFusedOps;
}
}  // namespace

void Work::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool Work::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void Work::finish(std::exception_ptr error) {
  std::vector<std::function<void(std::exception_ptr)>> callbacks;
  // Released after the lock: dropping a tensor that has a Python object takes the GIL, and a
  // Python thread polling done() holds the GIL while it waits for mu_.
  std::shared_ptr<void> keepalive;
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = error;
    done_ = true;
    keepalive.swap(keepalive_);
    callbacks.swap(callbacks_);
  }
  cv_.notify_all();
  keepalive.reset();
  for (auto& fn : callbacks) fn(error);
}

void Work::finish_all(Work* const* works, size_t count, std::exception_ptr error) {
  struct Left {
    std::vector<std::function<void(std::exception_ptr)>> callbacks;
    std::shared_ptr<void> keepalive;  // released after the lock, as in finish()
  };
  std::vector<Left> left(count);
  for (size_t i = 0; i < count; ++i) {
    Work& w = *works[i];
    std::lock_guard<std::mutex> lock(w.mu_);
    w.error_ = error;
    w.done_ = true;
    left[i].keepalive.swap(w.keepalive_);
    left[i].callbacks.swap(w.callbacks_);
  }
  for (size_t i = 0; i < count; ++i) works[i]->cv_.notify_all();
  for (size_t i = 0; i < count; ++i) {
    left[i].keepalive.reset();
    for (auto& fn : left[i].callbacks) fn(error);
  }
}

void Work::then(std::function<void(std::exception_ptr)> fn) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!done_) {
    callbacks_.push_back(std::move(fn));
    return;
  }
  std::exception_ptr error = error_;
  lock.unlock();
  fn(error);
}

Engine::Engine(const Topology& topo, MPI_Comm control, bool homogeneous, const EngineOptions& options)
    : topo_(topo), options_(options), active_(options), coordinator_(control) {
  mpi_types_init();
  exec_ = std::make_unique<Executor>(topo_, homogeneous, active_);
  worker_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  // Leave through a coordination round of its own, after everything queued:
  // ranks still submitting learn that this rank is gone (CommError naming it)
  // instead of waiting for it.
  if (topo_.size > 1) {
    try {
      Signature sig;
      sig.kind = static_cast<int32_t>(Collective::SHUTDOWN);
      submit_custom(sig, "shutdown", "", nullptr, [] {}, true)->wait();
    } catch (const std::exception&) {
      // Others still submit: they got the same message, naming this rank.
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  exec_.reset();  // collective over the node (its shm window): every rank shuts down
  mpi_types_finalize();
}

EngineOptions Engine::options() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_;
}

namespace {

// A fingerprint of every option the ranks must share, for the agreement round.
uint64_t options_hash(const EngineOptions& o) {
  std::ostringstream s;
  s << o.ring_chunk_bytes << ',' << o.shm_chunk_bytes << ',' << o.auto_ring_min_bytes << ',' << o.check_consistency << ','
    << o.fusion_threshold_bytes << ',' << o.cycle_time_ms << ',' << o.staging_chunk_bytes << ',' << o.force_staging
    << ',' << o.force_device_direct << ',' << o.pair_by_name << ',' << o.peer_path << ',' << o.force_peer << ',' << o.peer_chunk_bytes;
  for (const auto& e : o.auto_table) s << ';' << e.first << ':' << static_cast<int>(e.second);
  return std::hash<std::string>{}(s.str()) & 0x7fffffffffffffffULL;
}

}  // namespace

void Engine::set_options(const EngineOptions& options) {
  Signature sig;
  sig.kind = static_cast<int32_t>(Collective::OPTIONS);
  sig.numel = static_cast<int64_t>(options_hash(options));
  sig.set_name("engine options");
  // Stall limits are per rank (each rank's own watchdog), so they are not compared.
  submit_custom(sig, "set_options", "", nullptr, [this, options] {
    std::lock_guard<std::mutex> lock(mu_);
    options_ = options;
  }, true)->wait();
}

std::string Engine::status() const {
  // Called on the worker while idle, with mu_ not held.
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream s;
  const double idle = std::chrono::duration<double>(std::chrono::steady_clock::now() - idle_since_).count();
  s << "its pycomm engine has been idle for " << static_cast<int>(idle)
    << " s, so it is outside pycomm (computing, or in another library's call)";
  if (!queue_.empty()) s << "; " << queue_.size() << " operation(s) queued, first " << queue_.front().sig.describe();
  s << "; its last operation was ";
  if (!last_op_.empty()) s << last_op_;
  else s << last_sig_.describe() << (last_count_ > 1 ? " and " + std::to_string(last_count_ - 1) + " fused" : "");
  return s.str();
}

Engine::Stats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s = stats_;
  s.rounds = coordinator_.rounds();
  return s;
}


// ---------------------------------------------------------------- queueing

void Engine::mark_by_name(Op& op) const {
  if (!options_.pair_by_name || op.sig.name[0] == '\0') return;
  switch (static_cast<Collective>(op.sig.kind)) {
    case Collective::ALLREDUCE: case Collective::BROADCAST: case Collective::ALLGATHER:
    case Collective::REDUCE_SCATTER: case Collective::ALLTOALL: case Collective::REDUCE:
    case Collective::GATHER: case Collective::SCATTER:
      op.sig.flags |= Signature::kByName;
      return;
    default:  // barriers, joins, options, shutdown, sessions, compressed allreduces: by order
      return;
  }
}

WorkPtr Engine::enqueue(Op&& op, bool inline_if_idle, SubmitterHold* held) {
  op.submitted = std::chrono::steady_clock::now();
  op.work->ready = take_submit_event();  // the submitter's stream-order event (device_event.h), if any
  WorkPtr work = op.work;
  std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
  // Holding mu_, the engine thread may wait for what the submitter holds; a submitter that finds
  // mu_ free has it to itself, so only one that must wait lets go first.
  if (!held || !lock.try_lock()) {
    if (held) held->release();
    lock.lock();
  }
  if (stopping_) throw CommError("pycomm engine is shutting down");
  mark_by_name(op);
  if (inline_if_idle && queue_.empty() && !busy_) {
    busy_ = true;
    active_ = options_;
    lock.unlock();
    std::vector<Op*> batch{&op};
    const size_t ran = execute(batch);
    lock.lock();
    if (ran == 0) queue_.push_front(std::move(op));  // pair_by_name: not this round; the worker proposes it again
    busy_ = false;
    // Wake the worker only if it has something to do: waking it after every inline call cost
    // a futex wake and two context switches per blocking allreduce (perf, bench/latency.py).
    const bool wake = !queue_.empty() || stopping_;
    lock.unlock();
    if (wake) cv_.notify_all();
    return work;
  }
  // The worker, holding a fusable head back for its cycle, needs waking only when the batch
  // it would take changes its mind (full, or ended by an op that cannot join it). A small
  // compatible allreduce joining a partial batch does not: skipping the wake-up saves a
  // context switch and a scan of the queue per submission (bench/fusion.py, 400 small
  // tensors). Its bytes are under threshold/kMaxFusedOps, so with the batch below
  // kMaxFusedOps ops it can reach the byte limit only behind a larger op; then the batch
  // (capped by take_batch as always) runs at the cycle's end instead of at once.
  const bool quiet = !inline_if_idle && op.fusable && !queue_.empty() && queue_.size() + 1 < kMaxFusedOps &&
                     compatible(queue_.front(), op) &&
                     op.allreduce.input.bytes() * kMaxFusedOps < active_.fusion_threshold_bytes;
  queue_.push_back(std::move(op));
  // A blocking caller waits for this op now and submits nothing more meanwhile:
  // do not hold it back for a fusion cycle (what is already queued still fuses).
  if (inline_if_idle) flush_ = true;
  lock.unlock();
  if (!quiet) cv_.notify_all();
  return work;
}

bool Engine::compatible(const Op& head, const Op& next) const {
  const AllreduceArgs &a = head.allreduce, &b = next.allreduce;
  return next.fusable && a.input.dtype == b.input.dtype && a.input.device == b.input.device &&
         a.input.device_index == b.input.device_index && a.op == b.op && a.average == b.average &&
         a.algorithm == b.algorithm && b.input.bytes() <= active_.fusion_threshold_bytes;
}

void Engine::loop() {
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    // While idle, answer the coordinator's stall queries every 100 ms.
    while (!cv_.wait_for(lock, std::chrono::milliseconds(parked_.empty() ? 100 : 10),
                         [this] { return !busy_ && (!queue_.empty() || stopping_ || parked_due()); })) {
      if (busy_) continue;
      busy_ = true;
      lock.unlock();
      try {
        coordinator_.answer_queries([this] { return status(); });
      } catch (const std::exception&) {
        // A failed answer only makes the stall report vaguer.
      }
      lock.lock();
      busy_ = false;
    }
    if (queue_.empty() && (stopping_ || !parked_due())) {
      if (!stopping_) continue;
      // Stopping, and everything submitted has run but what waited for other ranks' names.
      std::deque<Op> never = std::move(parked_);
      parked_.clear();
      lock.unlock();
      for (Op& op : never)
        op.work->finish(std::make_exception_ptr(CommError(
            "pycomm: " + op.sig.describe() + " was never submitted by every rank before the engine shut down "
            "(named operations pair by name: pair_by_name)")));
      return;
    }
    busy_ = true;
    active_ = options_;
    if (queue_.empty()) {  // pair_by_name: propose the parked operations alone
      lock.unlock();
      std::vector<Op*> none;
      execute(none);
      lock.lock();
      busy_ = false;
      lock.unlock();
      cv_.notify_all();
      continue;
    }

    const bool fusion = fuses(active_, queue_.front());
    // pair_by_name: a named operation also waits out the cycle, as Horovod's background thread takes
    // new operations once per cycle; its name is in flight at least that long (a caller that waits
    // flushes it at once).
    const bool by_name = (queue_.front().sig.flags & Signature::kByName) && active_.cycle_time_ms > 0;
    if (fusion || by_name) {  // give the head a cycle to gather company
      auto deadline = queue_.front().submitted +
                      std::chrono::microseconds(static_cast<int64_t>(active_.cycle_time_ms * 1000.0));
      gathering_ = true;
      const uint64_t takeovers = takeovers_;
      cv_.wait_until(lock, deadline, [&] {
        return stopping_ || flush_ || takeovers_ != takeovers || (fusion && !head_batch(nullptr));
      });
      // A waiter took the batch and runs it on its own thread; it clears busy_ when done.
      if (takeovers_ != takeovers) continue;
      gathering_ = false;
    }
    flush_ = false;
    std::vector<Op*> batch;
    head_batch(&batch);
    running_ = batch.size();
    lock.unlock();

    size_t ran = execute(batch);

    lock.lock();
    end_batch(ran);
    lock.unlock();
    cv_.notify_all();
  }
}

bool Engine::head_batch(std::vector<Op*>* batch) {
  return take_batch(queue_.begin(), queue_.end(), fuses(active_, queue_.front()), active_.fusion_threshold_bytes,
                    [this](const Op& head, const Op& next) { return compatible(head, next); }, batch);
}

void Engine::end_batch(size_t popped) {
  for (size_t i = 0; i < popped; ++i) queue_.pop_front();
  running_ = 0;
  busy_ = false;
}

size_t Engine::execute(std::vector<Op*>& batch) {
  // Coordination is needed to compare the calls, and to fuse: ranks may have
  // different numbers of tensors ready. Whether to coordinate depends only on
  // the operation and the options, so every rank makes the same choice.
  // Every operation is coordinated: with check_consistency off the round
  // still compares sizes (Signature::cheap), so a mismatch raises CommError
  // on every rank instead of overrunning a buffer, and ranks that left are
  // noticed. The shutdown round waits without stall reports: ranks may
  // legitimately finish at different times.
  if (!batch.empty() && static_cast<Collective>(batch.front()->sig.kind) == Collective::JOIN)
    return execute_join(batch);
  size_t count = 1;
  std::exception_ptr error;
  std::vector<Signature> heads;
  heads.reserve(batch.size());
  for (Op* op : batch) heads.push_back(op->sig);
  std::vector<Signature> proposal = heads;
  for (const Op& p : parked_) {  // pair_by_name: what waits aside is proposed after the head batch
    proposal.push_back(p.sig);
    proposal.back().flags |= Signature::kParked;
  }
  std::vector<timeline::Clock::time_point> submitted;
  if (timeline::on())
    for (Op* op : batch) submitted.push_back(op->submitted);
  std::optional<timeline::Batch> tl;
  if (!batch.empty()) tl.emplace(heads, submitted);
  const Op& first = batch.empty() ? parked_.front() : *batch.front();
  try {
    const char* what = first.fusable ? "pycomm.allreduce" : "pycomm";
    const bool leaving = static_cast<Collective>(first.sig.kind) == Collective::SHUTDOWN;
    count = coordinator_.agree(proposal, what, leaving ? StallOptions{0.0, 0.0} : active_.stall,
                               active_.check_consistency);
  } catch (...) {
    error = std::current_exception();
    count = 1;
  }
  // pair_by_name: the round may have set the head aside, run nothing, or picked a named operation.
  const Resolution& res = coordinator_.resolution();
  size_t popped = count;  // operations taken from the queue's head
  Op taken;               // a parked operation that runs now
  switch (res.kind) {
    case Resolution::PARK: {
      std::lock_guard<std::mutex> lock(mu_);
      parked_.push_back(std::move(*batch.front()));
      parked_retry_at_ = {};
      return 1;
    }
    case Resolution::RETRY: {
      std::lock_guard<std::mutex> lock(mu_);
      parked_retry_at_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
      return 0;
    }
    case Resolution::NAMED: {
      auto is_named = [&](const Op& op) {
        return (op.sig.flags & Signature::kByName) && res.name == op.sig.name;
      };
      std::lock_guard<std::mutex> lock(mu_);
      auto it = std::find_if(parked_.begin(), parked_.end(), is_named);  // the oldest first
      if (it != parked_.end()) {
        taken = std::move(*it);
        parked_.erase(it);
        batch.assign(1, &taken);
        popped = 0;
      } else if (batch.empty() || !is_named(*batch.front())) {
        throw CommError("pycomm internal error: the round chose '" + res.name + "', which this rank does not hold");
      } else {
        batch.resize(1);
        popped = 1;
      }
      count = 1;
      break;
    }
    case Resolution::HEAD:
      break;
  }
  if (batch.empty()) return 0;
  if (tl && popped == 0) tl.reset();  // a parked operation runs: not the batch the timeline opened
  if (tl) tl->decided(count);
  if (!error) {
    try {
      const int joined = coordinator_.join_info().joined;
      exec_->set_joined(joined);
      await_ready(batch, count);
      if (joined > 0) {
        run_with_joined(batch, count, joined);
      } else if (count == 1) {
        Op* op = batch.front();
        if (op->fusable) exec_->allreduce(op->allreduce);
        else op->body();
      } else {
        run_fused(batch, count);
      }
      record_done(batch, count);
    } catch (...) {
      error = std::current_exception();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.operations += count;
    if (count > 1) stats_.fused_tensors += count;
    exec_->memory_stats(&stats_);  // takes the movers' lock after mu_: mover_for never takes mu_
    // Described only when a stall report asks (status()): describe() formats through a stream.
    last_sig_ = batch.front()->sig;
    last_count_ = count;
    last_op_.clear();
    idle_since_ = std::chrono::steady_clock::now();
  }
  if (count == 1) {
    batch[0]->work->finish(error);
  } else {
    std::vector<Work*> finished(count);
    for (size_t i = 0; i < count; ++i) finished[i] = batch[i]->work.get();
    Work::finish_all(finished.data(), count, error);
  }
  return popped;
}

void Engine::run_fused(const std::vector<Op*>& batch, size_t count) {
  std::vector<const AllreduceArgs*> args(count);
  for (size_t i = 0; i < count; ++i) args[i] = &batch[i]->allreduce;
  exec_->fused_allreduce(args);
}

// ---------------------------------------------------------------- public operations

namespace {

std::vector<int64_t> flat_shape(const Buffer& b) { return {static_cast<int64_t>(b.count)}; }

}  // namespace

Engine::Op Engine::allreduce_op(AllreduceArgs&& args, std::shared_ptr<void> keepalive) {
  if (args.input.device != args.output.device || args.input.device_index != args.output.device_index)
    throw CommError("allreduce: input and out must be on the same device");
  Op op;
  op.work = std::make_shared<Work>("allreduce", args.name, std::move(keepalive));
  // The shape is read only here, into the signature that ranks compare: moved, not copied.
  op.sig = Signature::of(Collective::ALLREDUCE, args.input,
                         args.shape.empty() ? flat_shape(args.input) : std::move(args.shape), args.name);
  op.sig.op = static_cast<int32_t>(args.op);
  op.sig.extra = args.average ? 1 : 0;
  op.sig.algorithm = static_cast<int32_t>(args.algorithm);
  op.fusable = true;  // device tensors fuse in the device fusion buffer (executor.cpp)
  op.allreduce = std::move(args);
  // A device allreduce while ranks have joined runs alone (engine_join.cpp).
  if (op.allreduce.input.device != Device::CPU) op.body = [this, a = op.allreduce] { exec_->allreduce(a); };
  return op;
}

WorkPtr Engine::allreduce(AllreduceArgs&& args, std::shared_ptr<void> keepalive, bool blocking, SubmitterHold* held) {
  if (blocking && held) throw std::logic_error("Engine::allreduce: a blocking call must release what it holds first");
  return enqueue(allreduce_op(std::move(args), std::move(keepalive)), blocking, held);
}

std::vector<WorkPtr> Engine::allreduce_group(const std::vector<AllreduceArgs>& args, std::shared_ptr<void> keepalive,
                                             bool blocking) {
  std::vector<Op> ops;
  ops.reserve(args.size());
  for (const AllreduceArgs& a : args) ops.push_back(allreduce_op(AllreduceArgs(a), keepalive));
  std::vector<WorkPtr> works;
  works.reserve(ops.size());
  const auto now = std::chrono::steady_clock::now();
  EventPtr ready = take_submit_event();  // one producer event for the whole group (device_event.h)
  for (Op& op : ops) {
    op.submitted = now;
    op.work->ready = ready;
    works.push_back(op.work);
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) throw CommError("pycomm engine is shutting down");
  for (Op& op : ops) mark_by_name(op);
  if (blocking && queue_.empty() && !busy_ && !ops.empty()) {
    // An idle engine runs the group on the caller's thread, as a blocking allreduce runs inline:
    // no hand-off to the worker, whose wake-up on a loaded machine can cost a scheduler time slice.
    // Batches follow loop()'s rule (take_batch), with no cycle: the whole group is here.
    busy_ = true;
    active_ = options_;
    lock.unlock();
    auto compatible_ops = [this](const Op& head, const Op& next) { return compatible(head, next); };
    size_t first = 0;
    while (first < ops.size()) {
      std::vector<Op*> batch;
      auto head = ops.begin() + static_cast<std::ptrdiff_t>(first);
      take_batch(head, ops.end(), fuses(active_, *head), active_.fusion_threshold_bytes, compatible_ops, &batch);
      const size_t ran = execute(batch);
      if (ran == 0) break;  // pair_by_name: not this round; the worker proposes the rest again
      first += ran;
    }
    lock.lock();
    for (size_t i = ops.size(); i > first; --i) queue_.push_front(std::move(ops[i - 1]));
    busy_ = false;
    const bool wake = !queue_.empty() || stopping_;
    lock.unlock();
    if (wake) cv_.notify_all();
    return works;
  }
  for (Op& op : ops) queue_.push_back(std::move(op));
  // The caller waits for the group now and submits nothing more meanwhile: no fusion cycle.
  if (blocking && !works.empty()) flush_ = true;
  lock.unlock();
  if (!works.empty()) cv_.notify_all();
  return works;
}

WorkPtr Engine::submit_custom(const Signature& sig, const char* kind, std::string name,
                              std::shared_ptr<void> keepalive, std::function<void()> fn, bool blocking) {
  Op op;
  op.work = std::make_shared<Work>(kind, std::move(name), std::move(keepalive));
  op.sig = sig;
  op.body = std::move(fn);
  return enqueue(std::move(op), blocking);
}

WorkPtr Engine::broadcast(const Buffer& buf, int root, std::string name, std::shared_ptr<void> keepalive,
                          bool blocking) {
  Signature sig = Signature::of(Collective::BROADCAST, buf, flat_shape(buf), name);
  sig.root = root;
  return submit_custom(sig, "broadcast", std::move(name), std::move(keepalive), [this, buf, root] { exec_->broadcast(buf, root); },
                       blocking);
}

WorkPtr Engine::allgather(const Buffer& send, size_t rows, std::vector<int64_t> row_shape,
                          std::function<void*(size_t)> allocate, std::string name, std::shared_ptr<void> keepalive) {
  std::vector<int64_t> shape{0};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  Signature sig = Signature::of(Collective::ALLGATHER, send, shape, name);
  sig.numel = -1;  // first dimension may differ per rank
  size_t row_elems = 1;
  for (int64_t d : row_shape) row_elems *= static_cast<size_t>(d);
  const size_t row_bytes = row_elems * kernels::dtype_size(send.dtype);
  return submit_custom(sig, "allgather", std::move(name), std::move(keepalive),
                       [this, send, rows, row_bytes, allocate] { exec_->allgather(send, rows, row_bytes, allocate); },
                       false);
}

void Engine::flush() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Nothing held back: the queue holds only the batch being executed. A flag set then would
    // outlive it and cut the next batch's fusion cycle short (its head would leave alone).
    if (queue_.size() <= running_) return;
    flush_ = true;
  }
  cv_.notify_all();
}

void Engine::run_queued_for(const Work& work) {
  for (;;) {
    if (work.done()) return;
    std::unique_lock<std::mutex> lock(mu_);
    // Only a head of allreduces, the batch the worker would take (execute() settles pair_by_name's
    // outcomes, parking and retrying, as it does for the worker); a join, a backup session or any other
    // operation at the head stays with the worker.
    const bool takeable = !stopping_ && !queue_.empty() && (gathering_ || !busy_) && queue_.front().fusable;
    if (!takeable) {
      lock.unlock();
      flush();
      return;
    }
    if (gathering_) {  // the worker's batch: it sees the takeover and leaves busy_ to this thread
      gathering_ = false;
      ++takeovers_;
    } else {
      busy_ = true;
      active_ = options_;
    }
    flush_ = false;
    std::vector<Op*> batch;
    head_batch(&batch);
    running_ = batch.size();
    const uint64_t operations = stats_.operations;  // only the thread holding busy_ adds to it
    lock.unlock();

    // Taken from the queue's head: the batch, or under pair_by_name one parked (set aside) or none
    // (an operation that was parked before ran, or nothing ran).
    const size_t popped = execute(batch);

    lock.lock();
    end_batch(popped);
    const bool ran = stats_.operations != operations;
    if (ran) ++stats_.waiter_batches;
    // Wake the worker only if it has something to do (as after an inline call).
    const bool wake = !queue_.empty() || stopping_;
    lock.unlock();
    if (wake) cv_.notify_all();
    if (popped == 0 && !ran) return;  // pair_by_name: a round that ran nothing; the worker proposes again
  }
}

WorkPtr Engine::barrier(bool blocking) {
  Signature sig;
  sig.kind = static_cast<int32_t>(Collective::BARRIER);
  return submit_custom(sig, "barrier", "", nullptr, [this] { PYCOMM_MPI_CHECK(MPI_Barrier(topo_.world)); }, blocking);
}

WorkPtr Engine::reduce_scatter(const ReduceScatterArgs& args, std::shared_ptr<void> keepalive, bool blocking) {
  const int n = topo_.size, r = topo_.rank;
  if (args.segments.size() != static_cast<size_t>(n) + 1 || args.segments.front() != 0 ||
      args.segments.back() != args.input.count)
    throw CommError("reduce_scatter: the segment table must have size+1 offsets from 0 to the input's length");
  if (args.output.count != args.segments[r + 1] - args.segments[r] || args.output.dtype != args.input.dtype)
    throw CommError("reduce_scatter: the output must hold this rank's segment (" +
                    std::to_string(args.segments[r + 1] - args.segments[r]) + " elements of the input's dtype)");
  if (args.algorithm != Algorithm::AUTO && args.algorithm != Algorithm::RING && args.algorithm != Algorithm::MPI)
    throw CommError(std::string("reduce_scatter: algorithm '") + algorithm_name(args.algorithm) +
                    "' is an allreduce algorithm; choose auto, ring or mpi");
  Signature sig = Signature::of(Collective::REDUCE_SCATTER, args.input, args.shape, args.name);
  sig.op = static_cast<int32_t>(args.op);
  sig.extra = args.average ? 1 : 0;
  sig.algorithm = static_cast<int32_t>(args.algorithm);
  return submit_custom(sig, "reduce_scatter", args.name, std::move(keepalive), [this, args] { exec_->reduce_scatter(args); },
                       blocking);
}

WorkPtr Engine::alltoall(const AlltoallArgs& args, std::shared_ptr<void> keepalive, bool blocking) {
  const int n = topo_.size;
  if (args.send_rows.size() != static_cast<size_t>(n))
    throw CommError("alltoall: give one send count per rank (" + std::to_string(n) + ")");
  if (!args.recv_rows.empty() && args.recv_rows.size() != static_cast<size_t>(n))
    throw CommError("alltoall: give one receive count per rank (" + std::to_string(n) + ")");
  size_t rows = 0;
  for (size_t c : args.send_rows) rows += c;
  if (rows * args.row_elems != args.input.count)
    throw CommError("alltoall: the send counts add up to " + std::to_string(rows) + " rows but the input has " +
                    std::to_string(args.row_elems ? args.input.count / args.row_elems : 0));
  std::vector<int64_t> shape{0};
  shape.insert(shape.end(), args.row_shape.begin(), args.row_shape.end());
  Signature sig = Signature::of(Collective::ALLTOALL, args.input, shape, args.name);
  sig.numel = -1;  // rows differ per rank
  return submit_custom(sig, "alltoall", args.name, std::move(keepalive), [this, args] { exec_->alltoall(args); },
                       blocking);
}

WorkPtr Engine::compressed_allreduce(const CompressedArgs& args, std::shared_ptr<void> keepalive, bool blocking) {
  // Everything on the input's device: a compressed allreduce never moves a
  // tensor or its state to other memory behind the caller's back.
  auto where = [](const Buffer& b) {
    return b.device == Device::CPU ? std::string("the host") : "cuda:" + std::to_string(b.device_index);
  };
  auto same_device = [&](const Buffer& b) {
    return b.device == args.input.device && (b.device == Device::CPU || b.device_index == args.input.device_index);
  };
  if (args.input.dtype != DType::F32 || args.output.dtype != DType::F32 || args.input.count != args.output.count)
    throw CommError("compressed allreduce: input and output must be float32 buffers of the same size");
  if (!same_device(args.output))
    throw CommError("compressed allreduce of '" + args.name + "': the input is on " + where(args.input) +
                    ", out on " + where(args.output) + "; pass out on the input's device");
  if (args.compression == Compression::ONEBIT) {
    const OneBitLayout L = onebit_layout(args.input.count, topo_.size);
    const std::string dev = where(args.input);
    if (args.worker_residual.dtype != DType::F32 || args.worker_residual.count != L.n ||
        !same_device(args.worker_residual))
      throw CommError("compressed allreduce: the worker residual must be a float32 buffer of " +
                      std::to_string(L.n) + " elements on " + dev + " (the tensor's device)");
    if (args.server_residual.dtype != DType::F32 || args.server_residual.count != L.chunk ||
        !same_device(args.server_residual))
      throw CommError("compressed allreduce: the server residual must be a float32 buffer of " +
                      std::to_string(L.chunk) + " elements at " + std::to_string(topo_.size) + " ranks on " + dev +
                      " (the tensor's device)");
    if (args.mask.data && (args.mask.count != L.n || !same_device(args.mask)))
      throw CommError("compressed allreduce: the mask must be a buffer of " + std::to_string(L.n) + " bytes on " +
                      dev + " (the tensor's device)");
  }

  // The agreement check compares the compression too: it leads the name
  // ("onebit+mask:grad.w"), which the disagreement message shows.
  Signature sig;
  sig.kind = static_cast<int32_t>(Collective::ALLREDUCE);
  sig.dtype = static_cast<int32_t>(args.input.dtype);
  sig.device = static_cast<int32_t>(args.input.device);
  sig.numel = static_cast<int64_t>(args.input.count);
  sig.ndim = 1;
  sig.dims[0] = sig.numel;
  sig.op = static_cast<int32_t>(ReduceOp::SUM);
  sig.extra = args.average ? 1 : 0;
  std::string tag = compression_name(args.compression);
  if (args.mask.data) tag += "+mask";
  sig.set_name(tag + ":" + args.name);

  return submit_custom(sig, "allreduce", tag + " " + args.name, std::move(keepalive),
                       [this, args] { exec_->compressed_allreduce(args); }, blocking);
}

void Engine::await_ready(const std::vector<Op*>& batch, size_t count) {
  // A fused batch is first touched by the pack kernel on the mover's lane, so
  // ordering the lanes after the producer is enough. Everything else may hand
  // the pointers to MPI or to host copies at once: the engine thread (never
  // the submitter's) also waits for the producer.
  // So is one allreduce on the peer path, whose memory only the device reads.
  const bool unjoined_allreduce = batch.front()->fusable && coordinator_.join_info().joined == 0;
  const bool stream_only =
      unjoined_allreduce && (count > 1 || exec_->on_peer_path(batch.front()->allreduce));
  uint64_t waited = 0;
  for (size_t i = 0; i < count; ++i) {
    const EventPtr& ev = batch[i]->work->ready;
    if (!ev) continue;
    exec_->mover_of_device(ev->device()).wait_event(*ev);
    if (!stream_only) ev->synchronize();
    ++waited;
  }
  if (waited) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.ready_waits += waited;
  }
}

void Engine::record_done(const std::vector<Op*>& batch, size_t count) {
  // One event per device for the whole batch, recorded after the mover's last work.
  std::map<int, EventPtr> done;
  for (size_t i = 0; i < count; ++i) {
    Work& w = *batch[i]->work;
    if (!w.ready) continue;
    const int device = w.ready->device();
    auto it = done.find(device);
    if (it == done.end()) it = done.emplace(device, exec_->mover_of_device(device).record_done()).first;
    w.set_done_event(it->second);
    w.ready.reset();  // back to its pool
  }
  if (!done.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.done_events += done.size();
  }
}

}  // namespace comm
}  // namespace pycomm
