#include "engine.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>

#include "../kernels/fusion.h"
#include "../kernels/reduce.h"
#include "algorithms.h"
#include "device_ops.h"
#include "mpi_types.h"
#include "shm_window.h"
#include "staging.h"
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
    : topo_(topo), homogeneous_(homogeneous), options_(options), active_(options), coordinator_(control),
      staging_(std::make_unique<StagingBuffers>()) {
  mpi_types_init();
  cuda_aware_ = mpi_is_cuda_aware();
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
      submit_custom(sig, "shutdown", nullptr, [] {}, true)->wait();
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
  shm_.reset();  // collective over the node: every rank shuts down
  staging_.reset();  // before the movers that own its memory
  cuda_movers_.clear();
  host_mover_.reset();
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
    << ',' << o.force_device_direct << ',' << o.pair_by_name;
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
  submit_custom(sig, "set_options", nullptr, [this, options] {
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

ShmWindow& Engine::shm() {
  if (!shm_) shm_ = std::make_unique<ShmWindow>(topo_.local);
  shm_->set_growth_limit(active_.fusion_threshold_bytes);  // the same on every rank (agreed options)
  return *shm_;
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

WorkPtr Engine::enqueue(Op op, bool inline_if_idle) {
  op.submitted = std::chrono::steady_clock::now();
  op.work->ready = take_submit_event();  // the submitter's stream-order event (device_event.h), if any
  WorkPtr work = op.work;
  std::unique_lock<std::mutex> lock(mu_);
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

    auto compatible_ops = [this](const Op& head, const Op& next) { return compatible(head, next); };
    const bool fusion = fuses(active_, queue_.front());
    auto head_batch = [&](std::vector<Op*>* batch) {
      return take_batch(queue_.begin(), queue_.end(), fusion, active_.fusion_threshold_bytes, compatible_ops, batch);
    };
    // pair_by_name: a named operation also waits out the cycle, as Horovod's background thread takes
    // new operations once per cycle; its name is in flight at least that long (a caller that waits
    // flushes it at once).
    const bool by_name = (queue_.front().sig.flags & Signature::kByName) && active_.cycle_time_ms > 0;
    if (fusion || by_name) {  // give the head a cycle to gather company
      auto deadline = queue_.front().submitted +
                      std::chrono::microseconds(static_cast<int64_t>(active_.cycle_time_ms * 1000.0));
      cv_.wait_until(lock, deadline, [&] { return stopping_ || flush_ || (fusion && !head_batch(nullptr)); });
    }
    flush_ = false;
    std::vector<Op*> batch;
    head_batch(&batch);
    running_ = batch.size();
    lock.unlock();

    size_t ran = execute(batch);

    lock.lock();
    for (size_t i = 0; i < ran; ++i) queue_.pop_front();
    running_ = 0;
    busy_ = false;
    lock.unlock();
    cv_.notify_all();
  }
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
      await_ready(batch, count);
      const int joined = coordinator_.join_info().joined;
      if (joined > 0) {
        run_with_joined(batch, count, joined);
      } else if (count == 1) {
        Op* op = batch.front();
        if (op->fusable) run_allreduce(op->allreduce);
        else op->body();
      } else {
        run_fused(std::vector<Op*>(batch.begin(), batch.begin() + static_cast<std::ptrdiff_t>(count)));
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
    if (shm_) stats_.shm_allocations = shm_->allocations(), stats_.shm_segment_bytes = shm_->capacity();
    stats_.fusion_buffer_bytes = fusion_buffer_.size();
    stats_.staging_bytes = 2 * staging_->bytes;
    stats_.device_cache_bytes = stats_.device_cache_allocations = 0;
    stats_.device_fusion_bytes = stats_.device_fusion_allocations = 0;
    auto count_mover = [this](const MemoryMover* m) {
      if (!m) return;
      stats_.device_cache_bytes += m->cached_bytes();
      stats_.device_cache_allocations += m->allocations();
      stats_.device_fusion_bytes += m->fusion_bytes();
      stats_.device_fusion_allocations += m->fusion_allocations();
    };
    {
      std::lock_guard<std::mutex> movers(movers_mu_);  // after mu_: mover_for never takes mu_
      count_mover(host_mover_.get());
      for (const auto& m : cuda_movers_) count_mover(m.get());
    }
    const WorkspaceStats ws = device_ops_workspace_stats();  // the compressed allreduce's device workspaces
    stats_.device_cache_bytes += ws.bytes;
    stats_.device_cache_allocations += ws.allocations;
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

// ---------------------------------------------------------------- allreduce

JobShape Engine::job_shape() const {
  return JobShape{topo_.size, topo_.num_nodes, topo_.local_size, homogeneous_};
}

Algorithm Engine::resolve(Algorithm requested, size_t bytes, const EngineOptions& o) const {
  if (requested != Algorithm::AUTO) return requested;
  return choose_auto(bytes, job_shape(), o.auto_ring_min_bytes, o.auto_table);
}

const AllreduceAlgorithm& Engine::checked_algorithm(Algorithm a) const {
  const std::string why = allreduce_refusal(a, job_shape());
  if (!why.empty()) throw CommError(why);
  return allreduce_algorithm(a);
}

AllreduceRun Engine::allreduce_run(MemoryMover* device) {
  return AllreduceRun{topo_, active_.ring_chunk_bytes, active_.shm_chunk_bytes,
                      [this]() -> ShmWindow& { return shm(); }, device};
}

namespace {

// PYCOMM_DEVICE_CACHE_MB: the most working memory a mover keeps between operations (default 256).
size_t device_cache_limit() {
  const char* raw = std::getenv("PYCOMM_DEVICE_CACHE_MB");
  if (!raw || !*raw) return size_t(256) << 20;
  char* end = nullptr;
  unsigned long long mb = std::strtoull(raw, &end, 10);
  if (*end != '\0' || raw[0] == '-')
    throw CommError(std::string("PYCOMM_DEVICE_CACHE_MB=") + raw + " must be a whole number of MiB (0: keep nothing)");
  return static_cast<size_t>(mb) << 20;
}

}  // namespace

std::pair<void*, void*> Engine::device_lanes(int device) {
  Buffer b;
  b.device = Device::CUDA;
  b.device_index = device;
  MemoryMover& m = mover_for(b);
  return {m.lane_stream(0), m.lane_stream(1)};
}

MemoryMover& Engine::mover_for(const Buffer& buf) {
  std::lock_guard<std::mutex> lock(movers_mu_);
  if (buf.device == Device::CPU) {
    if (!host_mover_) {
      host_mover_ = std::make_unique<HostMover>();
      host_mover_->set_cache_limit(device_cache_limit());
    }
    return *host_mover_;
  }
  const size_t d = static_cast<size_t>(std::max(buf.device_index, 0));
  if (cuda_movers_.size() <= d) cuda_movers_.resize(d + 1);
  if (!cuda_movers_[d]) {
    cuda_movers_[d] = make_cuda_mover(static_cast<int>(d));
    cuda_movers_[d]->set_cache_limit(device_cache_limit());
  }
  return *cuda_movers_[d];
}

void Engine::check_direct(const Buffer& buf, const std::string& what) const {
  if (buf.device == Device::CPU) return;  // host memory (the stand-ins included): any MPI reads it
  const std::string why = direct_path_refusal(what, cuda_aware_, active_.force_device_direct, mpi_library_cuda_support(),
                                              std::getenv("PYCOMM_CUDA_AWARE"));
  if (!why.empty()) throw CommError(why);
}

void Engine::run_allreduce(const AllreduceArgs& a) {
  const bool device = a.input.device != Device::CPU;
  if ((device && cuda_aware_) || active_.force_device_direct) {
    check_direct(a.input, "allreduce of '" + a.name + "'");
    return run_device_allreduce(a);
  }
  if (device || active_.force_staging) return run_staged_allreduce(a);
  run_host_allreduce(a);
}

// Device memory with a CUDA-aware MPI: device pointers go straight to MPI
// (GPUDirect RDMA where the cluster has it) and the reductions run on the GPU.
// There is no host shared-memory window on this path: `auto` replaces an
// algorithm without a device form (shm, hierarchical_master) by the nearest one
// with it (device_substitute); naming one explicitly is an error.
void Engine::run_device_allreduce(const AllreduceArgs& a) {
  const Buffer& out = a.output;
  Algorithm algo = resolve(a.algorithm, out.bytes(), active_);
  if (a.algorithm == Algorithm::AUTO) algo = device_substitute(algo, out.bytes(), active_.auto_ring_min_bytes);
  const AllreduceAlgorithm& entry = allreduce_algorithm(algo);
  if (!entry.device) {
    std::string names;
    for (const auto& e : allreduce_algorithms())
      if (e.device) names += std::string(names.empty() ? "'" : ", '") + e.name + "'";
    throw CommError(std::string("allreduce algorithm '") + entry.name +
                    "' needs a host shared-memory window; device memory under a CUDA-aware MPI runs " + names);
  }
  checked_algorithm(algo);
  MemoryMover& gpu = mover_for(out);
  gpu.wait_lane(0);  // a fused batch's pack (lane 0) has written the buffer MPI is about to read
  if (out.data != a.input.data && a.input.count) gpu.copy(out.data, a.input.data, a.input.bytes());
  if (out.count == 0 || topo_.size == 1) return;
  const AverageRule avg = AverageRule::of(a.average, out.dtype, topo_.size);
  if (avg.before != 1.0) gpu.scale(out.data, out.count, out.dtype, avg.before);
  entry.device(out, a.op, allreduce_run(&gpu));
  if (avg.after != 1.0) gpu.scale(out.data, out.count, out.dtype, avg.after);
}

// Device memory with an MPI that cannot touch it (or any memory, when forced
// for testing): chunks go down to pinned host buffers, are reduced across
// ranks on the host by the chosen algorithm, and go back up.
void Engine::run_staged_allreduce(const AllreduceArgs& a) {
  if (a.input.count == 0) return;
  MemoryMover& mover = mover_for(a.input);
  // No host wait for the last uploads: the done event (record_done) and a fused batch's unpack
  // (lane 0) follow them on the device.
  staged_allreduce(a.input, a.output, mover, *staging_, active_.staging_chunk_bytes, [&](const Buffer& chunk) {
    AllreduceArgs h = a;
    h.input = h.output = chunk;
    run_host_allreduce(h);
  }, false);
}

void Engine::run_host_allreduce(const AllreduceArgs& a) {
  const Buffer& out = a.output;
  if (out.data != a.input.data && a.input.count) std::memcpy(out.data, a.input.data, a.input.bytes());
  if (out.count == 0 || topo_.size == 1) return;

  // Check what the topology allows before any data moves (same verdict on every rank).
  const AllreduceAlgorithm& entry = checked_algorithm(resolve(a.algorithm, out.bytes(), active_));

  const AverageRule avg = AverageRule::of(a.average, out.dtype, topo_.size);
  if (avg.before != 1.0) kernels::scale_cpu(out.data, out.count, out.dtype, avg.before);

  timeline::Phase phase(timeline::on() ? entry.phase : nullptr);
  entry.host(out, a.op, allreduce_run(nullptr));
  if (avg.after != 1.0) kernels::scale_cpu(out.data, out.count, out.dtype, avg.after);
}

void Engine::run_fused(const std::vector<Op*>& ops) {
  const AllreduceArgs& head = ops.front()->allreduce;
  if (device_fusion(head)) return run_device_fused(ops);
  const DType dtype = head.input.dtype;
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  std::vector<size_t> counts;
  size_t total = 0;
  for (const Op* op : ops) {
    srcs.push_back(op->allreduce.input.data);
    dsts.push_back(op->allreduce.output.data);
    counts.push_back(op->allreduce.input.count);
    total += op->allreduce.input.count;
  }
  const size_t bytes = total * kernels::dtype_size(dtype);
  const Algorithm algo = resolve(head.algorithm, bytes, active_);
  // Refused shapes fall through to run_allreduce, which names the reason.
  const WindowFusion window = allreduce_refusal(algo, job_shape()).empty() ? allreduce_algorithm(algo).fusion
                                                                            : WindowFusion::NONE;
  if (!active_.force_staging && topo_.size > 1 && topo_.local_size > 1 && window != WindowFusion::NONE) {
    FusedTensors t;
    t.srcs = srcs;
    t.dsts = dsts;
    t.counts = counts;
    t.dtype = dtype;
    t.world_size = topo_.size;
    const AverageRule avg = AverageRule::of(head.average, dtype, topo_.size);
    timeline::Phase phase("SHM_FUSED_ALLREDUCE");
    windowed_fused_allreduce(t, head.op, avg.before != 1.0, avg.after, shm(),
                             window == WindowFusion::CROSS ? topo_.cross : MPI_COMM_NULL,
                             active_.ring_chunk_bytes, active_.shm_chunk_bytes);
    return;
  }
  if (fusion_buffer_.size() < bytes) fusion_buffer_.resize(bytes);
  timeline::Phase phase("PACK");
  // One pack in batch order (the same on every rank), one allreduce, one
  // unpack with the average's 1/N fused in (fp16/bf16 are pre-divided instead).
  kernels::fusion_pack_cpu(srcs.data(), counts.data(), counts.size(), fusion_buffer_.data(), dtype);
  double unpack_scale = 1.0;
  AllreduceArgs fused = fused_args(head, fusion_buffer_.data(), total, &unpack_scale);
  phase.next(nullptr);
  run_allreduce(fused);
  phase.next("UNPACK");
  kernels::fusion_unpack_cpu(fusion_buffer_.data(), dsts.data(), counts.data(), counts.size(), dtype, unpack_scale);
}

AllreduceArgs Engine::fused_args(const AllreduceArgs& head, void* flat, size_t total, double* unpack_scale) const {
  AllreduceArgs fused = head;
  fused.input.data = fused.output.data = flat;
  fused.input.count = fused.output.count = total;
  // A division after the sum moves into the unpack; a division before it stays with the allreduce.
  *unpack_scale = AverageRule::of(head.average, head.input.dtype, topo_.size).after;
  if (*unpack_scale != 1.0) fused.average = false;
  return fused;
}

// ---------------------------------------------------------------- public operations

namespace {

std::vector<int64_t> flat_shape(const Buffer& b) { return {static_cast<int64_t>(b.count)}; }

}  // namespace

Engine::Op Engine::allreduce_op(const AllreduceArgs& args, std::shared_ptr<void> keepalive) {
  if (args.input.device != args.output.device || args.input.device_index != args.output.device_index)
    throw CommError("allreduce: input and out must be on the same device");
  Op op;
  op.work = std::make_shared<Work>("allreduce " + args.name, std::move(keepalive));
  op.sig = Signature::of(Collective::ALLREDUCE, args.input, args.shape.empty() ? flat_shape(args.input) : args.shape,
                         args.name);
  op.sig.op = static_cast<int32_t>(args.op);
  op.sig.extra = args.average ? 1 : 0;
  op.sig.algorithm = static_cast<int32_t>(args.algorithm);
  op.fusable = true;  // device tensors fuse in the device fusion buffer (engine_device.cpp)
  op.allreduce = args;
  // A device allreduce while ranks have joined runs alone (engine_join.cpp).
  if (args.input.device != Device::CPU) op.body = [this, args] { run_allreduce(args); };
  return op;
}

WorkPtr Engine::allreduce(const AllreduceArgs& args, std::shared_ptr<void> keepalive, bool blocking) {
  return enqueue(allreduce_op(args, std::move(keepalive)), blocking);
}

std::vector<WorkPtr> Engine::allreduce_group(const std::vector<AllreduceArgs>& args, std::shared_ptr<void> keepalive,
                                             bool blocking) {
  std::vector<Op> ops;
  ops.reserve(args.size());
  for (const AllreduceArgs& a : args) ops.push_back(allreduce_op(a, keepalive));
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

WorkPtr Engine::submit_custom(const Signature& sig, std::string description, std::shared_ptr<void> keepalive,
                              std::function<void()> fn, bool blocking) {
  Op op;
  op.work = std::make_shared<Work>(std::move(description), std::move(keepalive));
  op.sig = sig;
  op.body = std::move(fn);
  return enqueue(std::move(op), blocking);
}

WorkPtr Engine::broadcast(const Buffer& buf, int root, std::string name, std::shared_ptr<void> keepalive,
                          bool blocking) {
  Signature sig = Signature::of(Collective::BROADCAST, buf, flat_shape(buf), name);
  sig.root = root;
  return submit_custom(sig, "broadcast " + name, std::move(keepalive), [this, buf, root] {
    if (topo_.size == 1 || buf.count == 0) return;
    // Host memory goes to MPI as it is, unless force_staging makes it stand in for device memory.
    const bool staged = buf.device == Device::CPU ? active_.force_staging && !active_.force_device_direct
                                                  : !cuda_aware_;
    if (!staged) {
      check_direct(buf, "broadcast");
      return comm::broadcast(buf, root, topo_.world);
    }
    staged_broadcast(buf, root);
  }, blocking);
}

// Device memory without a CUDA-aware MPI: through the two cached pinned staging chunks, double-
// buffered as in staged_allreduce (staging.h). Chunk k (staging_chunk_bytes): the root copies it down
// on lane k % 2 while chunk k-1 is broadcast; the others broadcast into the host chunk and copy it up
// on lane k % 2. The host waits per chunk, for the copy MPI reads next (root) or the upload whose
// buffer it reuses (others); the last uploads are ordered by the done event. Bytes per rank: S down
// (root) or S up (others), S over MPI.
void Engine::staged_broadcast(const Buffer& buf, int root) {
  MemoryMover& mover = mover_for(buf);
  const size_t bytes = buf.bytes();
  const size_t chunk = staged_broadcast_chunk();
  const size_t chunks = (bytes + chunk - 1) / chunk;
  const bool is_root = topo_.rank == root;
  staging_->reserve(mover, std::min(bytes, chunk));
  char* base = static_cast<char*>(buf.data);
  auto len_of = [&](size_t k) { return std::min(chunk, bytes - k * chunk); };
  if (is_root) mover.to_host_async(staging_->chunk[0], base, len_of(0), 0);
  for (size_t k = 0; k < chunks; ++k) {
    const int lane = static_cast<int>(k % 2);
    mover.wait_lane(lane);
    if (is_root && k + 1 < chunks)
      mover.to_host_async(staging_->chunk[1 - lane], base + (k + 1) * chunk, len_of(k + 1), 1 - lane);
    PYCOMM_MPI_CHECK(MPI_Bcast(staging_->chunk[lane], static_cast<int>(len_of(k)), MPI_BYTE, root, topo_.world));
    if (!is_root) mover.to_device_async(base + k * chunk, staging_->chunk[lane], len_of(k), lane);
  }
  mover.join_lanes();
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
  return submit_custom(sig, "allgather " + name, std::move(keepalive), [this, send, rows, row_bytes, allocate] {
    if (send.device == Device::CPU || cuda_aware_) {
      check_direct(send, "allgather");
      allgatherv(send.data, rows, row_bytes, topo_.world, allocate);
      return;
    }
    MemoryMover& mover = mover_for(send);  // device memory through host copies
    std::vector<char> mine(rows * row_bytes), all;
    mover.to_host_async(mine.data(), send.data, mine.size(), 0);
    mover.wait_lane(0);
    void* device_out = nullptr;
    allgatherv(mine.data(), rows, row_bytes, topo_.world, [&](size_t total_rows) -> void* {
      device_out = allocate(total_rows);
      all.resize(total_rows * row_bytes);
      return all.data();
    });
    if (!all.empty()) {
      mover.to_device_async(device_out, all.data(), all.size(), 0);
      mover.wait_lane(0);
    }
  }, false);
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

WorkPtr Engine::barrier(bool blocking) {
  Signature sig;
  sig.kind = static_cast<int32_t>(Collective::BARRIER);
  return submit_custom(sig, "barrier", nullptr, [this] { PYCOMM_MPI_CHECK(MPI_Barrier(topo_.world)); }, blocking);
}

}  // namespace comm
}  // namespace pycomm
