#include "engine.h"

#include <cstring>
#include <sstream>

#include "../kernels/reduce.h"
#include "algorithms.h"
#include "mpi_types.h"
#include "signature.h"

namespace pycomm {
namespace comm {

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::AUTO: return "auto";
    case Algorithm::RING: return "ring";
    case Algorithm::MPI: return "mpi";
  }
  return "unknown";
}

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
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = error;
    done_ = true;
    keepalive_.reset();
  }
  cv_.notify_all();
}

Engine::Engine(const Topology& topo, const EngineOptions& options) : topo_(topo), options_(options) {
  mpi_types_init();
  worker_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  mpi_types_finalize();
}

void Engine::set_options(const EngineOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  options_ = options;
}

uint64_t Engine::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

EngineOptions Engine::options() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_;
}

WorkPtr Engine::submit(std::string description, std::shared_ptr<void> keepalive, std::function<void()> body,
                       bool inline_if_idle) {
  auto work = std::make_shared<Work>(std::move(description), std::move(keepalive));
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) throw CommError("pycomm engine is shutting down");
    if (!(inline_if_idle && queue_.empty() && !busy_)) {
      queue_.emplace_back(work, std::move(body));
      lock.unlock();
      cv_.notify_all();
      return work;
    }
    busy_ = true;
    active_ = options_;
  }
  run_item(work, body);
  return work;
}

void Engine::run_item(const WorkPtr& work, const std::function<void()>& body) {
  std::exception_ptr error;
  try {
    body();
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++completed_;
    busy_ = false;
  }
  cv_.notify_all();
  work->finish(error);
}

void Engine::loop() {
  for (;;) {
    std::pair<WorkPtr, std::function<void()>> item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return (stopping_ && !busy_) || (!queue_.empty() && !busy_); });
      if (queue_.empty()) return;  // stopping, and everything submitted has run
      item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      active_ = options_;  // options are read only between operations
    }
    run_item(item.first, item.second);
  }
}

namespace {

Signature signature_of(Collective kind, const Buffer& b, const std::vector<int64_t>& shape, const std::string& name) {
  Signature s;
  s.kind = static_cast<int32_t>(kind);
  s.dtype = static_cast<int32_t>(b.dtype);
  s.numel = static_cast<int64_t>(b.count);
  s.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size() && i < static_cast<size_t>(Signature::kMaxDims); ++i) s.dims[i] = shape[i];
  s.set_name(name);
  return s;
}

std::vector<int64_t> flat_shape(const Buffer& b) { return {static_cast<int64_t>(b.count)}; }

}  // namespace

void Engine::run_allreduce(const AllreduceArgs& a) {
  const Buffer& out = a.output;
  if (out.data != a.input.data && a.input.count) std::memcpy(out.data, a.input.data, a.input.bytes());
  if (out.count == 0 || topo_.size == 1) return;

  // Averages of fp16/bf16 are pre-divided: a sum of N values near the top of
  // the fp16 range overflows before the division could rescue it.
  const bool half = out.dtype == DType::F16 || out.dtype == DType::BF16;
  const double inv_n = 1.0 / static_cast<double>(topo_.size);
  if (a.average && half) kernels::scale_cpu(out.data, out.count, out.dtype, inv_n);

  Algorithm algo = a.algorithm;
  if (algo == Algorithm::AUTO) algo = out.bytes() < active_.auto_ring_min_bytes ? Algorithm::MPI : Algorithm::RING;
  switch (algo) {
    case Algorithm::RING: ring_allreduce(out, a.op, topo_.world, active_.ring_chunk_bytes); break;
    case Algorithm::MPI: mpi_allreduce(out, a.op, topo_.world); break;
    default: throw CommError("allreduce: unknown algorithm");
  }
  if (a.average && !half) kernels::scale_cpu(out.data, out.count, out.dtype, inv_n);
}

WorkPtr Engine::allreduce(const AllreduceArgs& args, std::shared_ptr<void> keepalive, bool blocking) {
  if (args.input.device != Device::CPU || args.output.device != Device::CPU)
    throw CommError("allreduce: this pycomm build handles host memory only");
  Signature sig = signature_of(Collective::ALLREDUCE, args.input, flat_shape(args.input), args.name);
  sig.op = static_cast<int32_t>(args.op);
  sig.extra = args.average ? 1 : 0;
  sig.algorithm = static_cast<int32_t>(args.algorithm);
  return submit("allreduce " + args.name, std::move(keepalive), [this, args, sig] {
    if (active_.check_consistency) check_agreement(sig, topo_.world, "pycomm.allreduce");
    run_allreduce(args);
  }, blocking);
}

WorkPtr Engine::broadcast(const Buffer& buf, int root, std::string name, std::shared_ptr<void> keepalive,
                          bool blocking) {
  Signature sig = signature_of(Collective::BROADCAST, buf, flat_shape(buf), name);
  sig.root = root;
  return submit("broadcast " + name, std::move(keepalive), [this, buf, root, sig] {
    if (active_.check_consistency) check_agreement(sig, topo_.world, "pycomm.broadcast");
    if (topo_.size > 1 && buf.count) comm::broadcast(buf, root, topo_.world);
  }, blocking);
}

WorkPtr Engine::allgather(const Buffer& send, size_t rows, std::vector<int64_t> row_shape,
                          std::function<void*(size_t)> allocate, std::string name, std::shared_ptr<void> keepalive) {
  std::vector<int64_t> shape{0};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  Signature sig = signature_of(Collective::ALLGATHER, send, shape, name);
  sig.numel = -1;  // first dimension may differ per rank
  size_t row_elems = 1;
  for (int64_t d : row_shape) row_elems *= static_cast<size_t>(d);
  const size_t row_bytes = row_elems * kernels::dtype_size(send.dtype);
  return submit("allgather " + name, std::move(keepalive), [this, send, rows, row_bytes, sig, allocate] {
    if (active_.check_consistency) check_agreement(sig, topo_.world, "pycomm.allgather");
    allgatherv(send.data, rows, row_bytes, topo_.world, allocate);
  });
}

WorkPtr Engine::barrier(bool blocking) {
  return submit("barrier", nullptr, [this] {
    Signature sig;
    sig.kind = static_cast<int32_t>(Collective::BARRIER);
    if (active_.check_consistency) check_agreement(sig, topo_.world, "pycomm.barrier");
    PYCOMM_MPI_CHECK(MPI_Barrier(topo_.world));
  }, blocking);
}

}  // namespace comm
}  // namespace pycomm
