#include "process_group_pycomm.h"

#include <climits>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "../bindings/bindings.h"
#ifdef PYCOMM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include "../comm/compressed_allreduce.h"
#include "../comm/engine.h"
#include "../comm/mpi_types.h"

namespace pycomm {
namespace c10d_backend {
namespace {

using c10d::OpType;
using WorkRef = c10::intrusive_ptr<c10d::Work>;
using FutureRef = c10::intrusive_ptr<c10::ivalue::Future>;

// ---------------------------------------------------------------- checks

// bindings::tensor_problem's rule, raised as torch's TypeError / ValueError (c10::Error).
comm::DType dtype_of(const at::Tensor& t, const char* op) {
  comm::DType d;
  const std::string why = bindings::dtype_problem(t, op, &d);
  TORCH_CHECK_TYPE(why.empty(), "pycomm backend: ", why);
  return d;
}

// Describe a tensor for the engine after checking it.
comm::Buffer buffer_of(const at::Tensor& t, const char* op) {
  comm::Buffer b;
  bool dtype_fault = false;
  const std::string why = bindings::tensor_problem(t, op, &b, &dtype_fault);
  TORCH_CHECK_TYPE(!dtype_fault, "pycomm backend: ", why);
  TORCH_CHECK_VALUE(why.empty(), "pycomm backend: ", why);
  return b;
}

const at::Tensor& single(std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "pycomm backend: ", op, " takes one tensor per process, got ",
                    tensors.size());
  return tensors[0];
}

struct OpChoice {
  comm::ReduceOp op;
  bool average;
};

const char* op_name(const c10d::ReduceOp& r) {
  static const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM", "UNUSED"};
  const int i = static_cast<int>(r.op_);
  return i >= 0 && i <= 9 ? names[i] : "?";
}

OpChoice reduce_op(const c10d::ReduceOp& r, const at::Tensor& t, const char* op) {
  switch (r.op_) {
    case c10d::ReduceOp::SUM: return {comm::ReduceOp::SUM, false};
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), "pycomm backend: ", op,
                       " with ReduceOp.AVG needs a floating-point tensor, got ", t.scalar_type());
      return {comm::ReduceOp::SUM, true};
    case c10d::ReduceOp::PRODUCT: return {comm::ReduceOp::PROD, false};
    case c10d::ReduceOp::MIN: return {comm::ReduceOp::MIN, false};
    case c10d::ReduceOp::MAX: return {comm::ReduceOp::MAX, false};
    default: break;
  }
  TORCH_CHECK_VALUE(false, "pycomm backend: ", op, " does not support ReduceOp.", op_name(r),
                    "; supported: SUM, AVG, PRODUCT, MIN, MAX");
}

int checked_count(size_t bytes, const char* op) {
  TORCH_CHECK_VALUE(bytes <= static_cast<size_t>(INT_MAX), "pycomm backend: ", op,
                    " moves at most 2 GiB per rank in one call, got ", bytes, " bytes");
  return static_cast<int>(bytes);
}

// The tensors of a submission, kept alive until the engine is done, and its ready event
// (bindings::keep, device_event.h): recorded on torch's current stream, which produced the tensors;
// the engine waits on it before it touches them, and the caller's thread goes on (no host block).
// Every op that calls it holds a bindings::SubmitScope around its engine call.
using Kept = std::shared_ptr<std::vector<at::Tensor>>;
Kept keep(std::vector<at::Tensor> tensors, int64_t group) {
  return bindings::keep(std::move(tensors), bindings::engine_of(group));
}
// What the body of a submit_custom op holds of its tensors: a weak reference to the Work's
// keepalive, which lives until the operation has run and is dropped outside the engine's lock. The
// engine destroys a finished op (its body) under that lock, and dropping a tensor that has a Python
// object there takes the GIL -- while a Python thread holding the GIL waits for the lock
// (pycomm.stats(), set_options): a deadlock. The body locks it for the time it runs.
using KeptRef = std::weak_ptr<std::vector<at::Tensor>>;

comm::Signature signature(comm::Collective kind, const at::Tensor& t, const char* op) {
  comm::Signature s;
  s.kind = static_cast<int32_t>(kind);
  s.dtype = static_cast<int32_t>(dtype_of(t, op));
  s.device = static_cast<int32_t>(t.is_cuda() ? comm::Device::CUDA : comm::Device::CPU);
  s.numel = t.numel();
  s.ndim = static_cast<int32_t>(t.dim());
  for (int64_t i = 0; i < t.dim() && i < comm::Signature::kMaxDims; ++i) s.dims[i] = t.size(i);
  return s;
}

// A host copy of `t` for code that hands memory to MPI itself (device tensors only).
at::Tensor host_view(const at::Tensor& t) { return t.is_cuda() ? t.to(at::kCPU) : t; }

// ---------------------------------------------------------------- work

// A collective in flight: its future is completed on the engine thread once
// the operation (and any copy into the caller's outputs) is done.
class PycommWork : public c10d::Work {
 public:
  // `work`: the engine's operation, whose done event wait() orders the caller's stream after (null for
  // the wrappers whose future completes after copies of their own).
  PycommWork(int rank, OpType type, std::vector<at::Tensor> outputs, FutureRef future, int64_t group,
             comm::WorkPtr work = nullptr)
      : c10d::Work(rank, type), outputs_(std::move(outputs)), future_(std::move(future)), group_(group),
        work_(std::move(work)) {}

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override { return future_->exception_ptr(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  // Whoever asks for the future will wait on it: torch's DDP reducer asks right after launching each
  // bucket, and a bucket already holds many gradients, so the engine does not hold it back for a
  // fusion cycle (ops queued behind a running one still fuse). Measured: DDP on the MLP of
  // bench/ddp_backends.py, 2 ranks, 1.15x gloo with the 2 ms cycle against 1.39x without it.
  FutureRef getFuture() override {
    flush();
    return future_;
  }

  // No per-call timeout: the engine's stall watchdog (PYCOMM_STALL_WARNING_S /
  // PYCOMM_STALL_ABORT_S) reports and ends operations that wait too long.
  // Stream order (device_event.h): once the engine has finished, the caller's current stream waits
  // for pycomm's device work (the done event); the host does not wait for the device. (The future's
  // own wait also orders the current stream, after the events recorded when it completed.)
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    // Someone waits: nothing is held back for fusion, and a batch the engine's worker has not taken
    // runs on this thread (Engine::run_queued_for). torch calls wait() without the GIL.
    if (work_) bindings::run_before_waiting(*work_, group_);
    else flush();
    future_->wait();
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    if (work_) bindings::order_current_stream(work_->done_event());
    return true;
  }

 private:
  void flush() {
    if (future_->completed()) return;
    try {
      bindings::engine_of(group_).flush();
    } catch (const comm::CommError&) {  // the group is gone: wait() reports the operation's own error
    }
  }

  std::vector<at::Tensor> outputs_;
  FutureRef future_;
  int64_t group_;
  comm::WorkPtr work_;
};

FutureRef make_future(const std::vector<at::Tensor>& outputs) {
  std::vector<c10::Device> devices;
  for (const auto& t : outputs)
    if (t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end())
      devices.push_back(t.device());
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devices);
}

// The submitter's current stream on CUDA device `device` (nullptr for none), and a scope that makes
// it current on the engine thread (giving that thread's stream and device back after).
void* caller_stream(int device) { return device >= 0 ? bindings::current_stream(device) : nullptr; }
class StreamScope {
 public:
  StreamScope(void* stream, int device) {
#ifdef PYCOMM_WITH_CUDA
    if (stream)
      guard_.emplace(c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream),
                                                      static_cast<c10::DeviceIndex>(device)));
#else
    (void)stream;
    (void)device;
#endif
  }

 private:
#ifdef PYCOMM_WITH_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
#endif
};

// Wrap engine work: `post` (copies into the outputs) runs on the engine thread
// after the operation, then the future completes with `outputs` or the error.
// Stream order (docs/gpu.md): `post` and the future's completion events run on the submitter's
// current stream of the outputs' device (captured here), after pycomm's done event, not on the engine
// thread's default stream, which is not ordered after pycomm's lanes.
WorkRef complete(int rank, OpType type, int64_t group, const comm::WorkPtr& work, std::vector<at::Tensor> outputs,
                 std::function<void()> post = {}) {
  FutureRef future = make_future(outputs);
  int device = -1;
  for (const auto& t : outputs)
    if (t.is_cuda()) device = t.get_device();
  comm::Work* w = work.get();  // alive while its callbacks run (Work::finish)
  work->then([future, outputs, post, device, w, caller = caller_stream(device)](std::exception_ptr error) {
    StreamScope on(caller, device);
    if (!error && device >= 0) bindings::order_current_stream(w->done_event());
    if (!error && post) {
      try {
        post();
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) future->setError(error);
    else future->markCompleted(c10::IValue(outputs));
  });
  return c10::make_intrusive<PycommWork>(rank, type, std::move(outputs), std::move(future), group, work);
}

// Point-to-point: an MPI request on the backend's own communicator.
class P2PWork : public c10d::Work {
 public:
  P2PWork(int rank, OpType type, at::Tensor tensor, at::Tensor host, bool copy_back)
      : c10d::Work(rank, type), tensor_(std::move(tensor)), host_(std::move(host)), copy_back_(copy_back) {}
  MPI_Request* request() { return &request_; }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      int flag = 0;
      PYCOMM_MPI_CHECK(MPI_Test(&request_, &flag, &status_));
      if (flag) finish();
    }
    return done_;
  }
  bool isSuccess() const override { return done_; }
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      PYCOMM_MPI_CHECK(MPI_Wait(&request_, &status_));
      finish();
    }
    return true;
  }
  int sourceRank() const override { return source_; }
  std::vector<at::Tensor> result() override { return {tensor_}; }

 private:
  void finish() {
    done_ = true;
    source_ = status_.MPI_SOURCE;
    if (copy_back_) tensor_.copy_(host_);
  }

  std::mutex mu_;
  at::Tensor tensor_, host_;
  bool copy_back_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  MPI_Status status_{};
  bool done_ = false;
  int source_ = -1;
};

}  // namespace

// ---------------------------------------------------------------- collectives

ProcessGroupPycomm::ProcessGroupPycomm(int rank, int size, int64_t group, MPI_Comm p2p,
                                       const std::string& compression)
    : c10d::Backend(rank, size), group_(group), p2p_(p2p) {
  comm::Compression id;
  if (comm::compression_from_name(compression, &id)) compression_ = static_cast<int>(id);
  else TORCH_CHECK_VALUE(compression.empty() || compression == "none", "pycomm backend: PYCOMM_COMPRESSION='",
                         compression, "' is not a compression; choose none, ", comm::compression_choices());
}

std::string ProcessGroupPycomm::compression() const {
  return compression_ ? comm::compression_name(static_cast<comm::Compression>(compression_)) : "none";
}

ProcessGroupPycomm::CompressionState ProcessGroupPycomm::compression_state() {
  std::lock_guard<std::mutex> lock(sites_mu_);
  CompressionState s;
  s.period = sites_.period();
  s.breaks = sites_.breaks();
  s.last = last_;
  s.residuals = residuals_.entries();
  return s;
}

void ProcessGroupPycomm::reset_compression() {
  std::lock_guard<std::mutex> lock(sites_mu_);
  sites_.reset();
  residuals_.clear();  // a call in flight keeps its residual tensors alive (keepalive)
  last_ = {-1, 0};
}

namespace {
// A Python UserWarning (the GIL is taken for it; it is shown once per process group).
void python_warning(const std::string& msg) {
  if (!Py_IsInitialized()) {
    TORCH_WARN(msg);
    return;
  }
  pybind11::gil_scoped_acquire gil;
  if (PyErr_WarnEx(PyExc_UserWarning, msg.c_str(), 1) < 0) throw pybind11::error_already_set();  // -W error
}

// Why the backend cannot compress this allreduce ("" if it can): the engine's
// compressed allreduce takes float32 host or CUDA memory (CUDA: the device
// form, device_compressed_allreduce.cpp, residuals on the tensor's device) and
// sums (or averages).
std::string why_uncompressed(const at::Tensor& t, const c10d::ReduceOp& r) {
  std::ostringstream why;
  if (t.scalar_type() != at::kFloat) why << "a " << t.scalar_type() << " tensor";
  else if (r.op_ != c10d::ReduceOp::SUM && r.op_ != c10d::ReduceOp::AVG) why << "ReduceOp." << op_name(r);
  return why.str();
}
}  // namespace

WorkRef ProcessGroupPycomm::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].layout() == at::kSparse) return sparse_allreduce(tensors[0], opts);
  ++seq_;
  bindings::SubmitScope submit;
  const at::Tensor& t = single(tensors, "allreduce");
  comm::AllreduceArgs a;
  a.input = a.output = buffer_of(t, "allreduce");
  OpChoice choice = reduce_op(opts.reduceOp, t, "allreduce");
  if (compression_) {
    const std::string why = why_uncompressed(t, opts.reduceOp);
    if (why.empty()) return compressed_allreduce(t, choice.average, !opts.asyncOp);
    if (!warned_.exchange(true))
      python_warning("PYCOMM_COMPRESSION=" + compression() + ": the pycomm backend compresses float32 "
                     "allreduces with ReduceOp SUM or AVG only; an allreduce of " + why + " was sent uncompressed "
                     "(exact), and so is every other such allreduce on this process group (warned once)");
  }
  a.op = choice.op;
  a.average = choice.average;
  a.algorithm = comm::Algorithm::AUTO;
  // async_op=False: run on this thread when the engine is idle (no hand-off to the engine thread).
  auto work = bindings::engine_of(group_).allreduce(std::move(a), keep({t}, group_), !opts.asyncOp);
  return complete(rank_, OpType::ALLREDUCE, group_, work, {t});
}

WorkRef ProcessGroupPycomm::allreduce_sparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  at::Tensor& t = const_cast<at::Tensor&>(single(tensors, "allreduce (sparse)"));
  return sparse_allreduce(t, opts);
}

// A sparse COO allreduce sums, as gloo's: every rank's indices (as nnz x sparse_dim rows) and values
// are gathered by two allgathers of any row count, concatenated and coalesced (entries at one index
// add up); the result replaces the input tensor.
WorkRef ProcessGroupPycomm::sparse_allreduce(at::Tensor& t, const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(t.layout() == at::kSparse, "pycomm backend: allreduce (sparse) takes a sparse COO tensor, got ",
                    t.layout());
  TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM, "pycomm backend: a sparse allreduce sums (ReduceOp.SUM); ",
                    "got ReduceOp.", op_name(opts.reduceOp));
  ++seq_;
  const at::Tensor c = t.coalesce();
  const at::Tensor idx = c._indices().t().contiguous();
  const at::Tensor val = c._values().contiguous();
  auto all_idx = std::make_shared<at::Tensor>(), all_val = std::make_shared<at::Tensor>();
  comm::Engine& engine = bindings::engine_of(group_);
  {
    bindings::SubmitScope submit;
    engine.allgather(buffer_of(idx, "allreduce (sparse indices)"), static_cast<size_t>(idx.size(0)), {idx.size(1)},
                     [all_idx, idx](size_t rows) -> void* {
                       *all_idx = at::empty({static_cast<int64_t>(rows), idx.size(1)}, idx.options());
                       return all_idx->data_ptr();
                     },
                     "", keep({idx}, group_));
  }
  bindings::SubmitScope submit;
  std::vector<int64_t> row(val.sizes().begin() + 1, val.sizes().end());
  auto work = engine.allgather(buffer_of(val, "allreduce (sparse values)"), static_cast<size_t>(val.size(0)), row,
                               [all_val, val](size_t rows) -> void* {
                                 std::vector<int64_t> shape(val.sizes().begin(), val.sizes().end());
                                 shape[0] = static_cast<int64_t>(rows);
                                 *all_val = at::empty(shape, val.options());
                                 return all_val->data_ptr();
                               },
                               "", keep({val}, group_));
  at::Tensor out = t;
  const std::vector<int64_t> sizes = t.sizes().vec();
  return complete(rank_, OpType::ALLREDUCE, group_, work, {t}, [all_idx, all_val, out, sizes]() mutable {
    TORCH_CHECK(all_idx->defined() && all_val->defined(), "pycomm backend: sparse allreduce: the gather failed");
    out.copy_(at::sparse_coo_tensor(all_idx->t(), *all_val, sizes).coalesce());
  });
}

// PYCOMM_COMPRESSION: the engine's compressed allreduce (compressed_allreduce.h),
// fp16/bf16 without state; onebit with the residuals of this call's site.
WorkRef ProcessGroupPycomm::compressed_allreduce(const at::Tensor& t, bool average, bool blocking) {
  bindings::SubmitScope submit;
  comm::CompressedArgs a;
  a.input = a.output = buffer_of(t, "allreduce");
  a.compression = static_cast<comm::Compression>(compression_);
  a.average = average;
  a.name = "c10d";
  std::vector<at::Tensor> keepalive{t};
  if (a.compression == comm::Compression::ONEBIT) {
    SiteKey key;
    key.dtype = static_cast<int32_t>(a.input.dtype);
    key.average = average;
    key.shape.assign(t.sizes().begin(), t.sizes().end());
    std::lock_guard<std::mutex> lock(sites_mu_);
    const Site site{sites_.next(key), key.hash()};
    if (site.first >= 0 && residuals_.size() > 2 * CallSites::kMaxPeriod)
      residuals_.erase_if([](const Site& s) { return s.first < 0; });  // bound the memory: drop the learning sites
    // Tagged with the key: a hash collision replaces the site's residuals (the newer key takes it).
    Residuals::Pair& r = residuals_.for_call(site, t, size_, key);
    last_ = site;
    a.worker_residual = buffer_of(r.worker, "allreduce");
    a.server_residual = buffer_of(r.server, "allreduce");
    a.name = site.first >= 0 ? "c10d site " + std::to_string(site.first) : "c10d learning";
    keepalive.push_back(r.worker);
    keepalive.push_back(r.server);
  }
  auto work = bindings::engine_of(group_).compressed_allreduce(a, keep(std::move(keepalive), group_), blocking);
  return complete(rank_, OpType::ALLREDUCE, group_, work, {t});
}

WorkRef ProcessGroupPycomm::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  ++seq_;
  bindings::SubmitScope submit;
  const at::Tensor& t = single(tensors, "broadcast");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "pycomm backend: broadcast root ", opts.rootRank,
                    " is not a rank of this group (0..", size_ - 1, ")");
  auto work = bindings::engine_of(group_).broadcast(buffer_of(t, "broadcast"), static_cast<int>(opts.rootRank), "",
                                                    keep({t}, group_), !opts.asyncOp);
  return complete(rank_, OpType::BROADCAST, group_, work, {t});
}

WorkRef ProcessGroupPycomm::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) {
  ++seq_;
  bindings::SubmitScope submit;
  comm::Buffer in = buffer_of(input, "all_gather_into_tensor");
  buffer_of(output, "all_gather_into_tensor");
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_ && output.scalar_type() == input.scalar_type() &&
                        output.device() == input.device(),
                    "pycomm backend: all_gather_into_tensor needs an output of world_size x the input's elements (",
                    input.numel() * size_, " ", input.scalar_type(), " on ", input.device(), "), got ",
                    output.numel(), " ", output.scalar_type(), " on ", output.device());
  void* out = output.data_ptr();
  const int n = size_;
  auto work = bindings::engine_of(group_).allgather(
      in, 1, {input.numel()},
      [out, n](size_t rows) -> void* {
        if (rows != static_cast<size_t>(n)) throw comm::CommError("all_gather_into_tensor: unexpected row count");
        return out;
      },
      "", keep({input, output}, group_));
  return complete(rank_, OpType::_ALLGATHER_BASE, group_, work, {output});
}

WorkRef ProcessGroupPycomm::allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) {
  const at::Tensor& input = single(inputs, "all_gather");
  TORCH_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(size_),
                    "pycomm backend: all_gather needs one list of world_size (", size_, ") output tensors");
  for (const auto& o : outputs[0])
    TORCH_CHECK_VALUE(o.numel() == input.numel() && o.scalar_type() == input.scalar_type(),
                      "pycomm backend: all_gather outputs must have the input's size and dtype (", input.numel(), " ",
                      input.scalar_type(), "), got ", o.numel(), " ", o.scalar_type());
  at::Tensor flat = at::empty({size_ * input.numel()}, input.options());
  at::Tensor in = input.contiguous();
  std::vector<at::Tensor> outs = outputs[0];
  auto work = _allgather_base(flat, in, opts);
  // Copy the pieces out on the engine thread, before the future completes.
  auto inner = c10::static_intrusive_pointer_cast<PycommWork>(work);
  FutureRef future = make_future(outs);
  const int64_t numel = input.numel();
  inner->getFuture()->addCallback([future, outs, flat, numel](c10::ivalue::Future& f) {
    if (f.hasError()) return future->setError(f.exception_ptr());
    try {
      for (size_t i = 0; i < outs.size(); ++i)
        outs[i].copy_(flat.narrow(0, static_cast<int64_t>(i) * numel, numel).view(outs[i].sizes()));
    } catch (...) {
      return future->setError(std::current_exception());
    }
    future->markCompleted(c10::IValue(outs));
  });
  std::vector<at::Tensor> result = outs;
  return c10::make_intrusive<PycommWork>(rank_, OpType::ALLGATHER, std::move(result), future, group_);
}

WorkRef ProcessGroupPycomm::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::ReduceScatterOptions& opts) {
  ++seq_;
  bindings::SubmitScope submit;
  comm::ReduceScatterArgs a;
  a.input = buffer_of(input, "reduce_scatter_tensor");
  a.output = buffer_of(output, "reduce_scatter_tensor");
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_ && output.scalar_type() == input.scalar_type() &&
                        output.device() == input.device(),
                    "pycomm backend: reduce_scatter_tensor needs an input of world_size x the output's elements (",
                    output.numel() * size_, " ", output.scalar_type(), " on ", output.device(), "), got ",
                    input.numel(), " ", input.scalar_type(), " on ", input.device());
  for (int j = 0; j <= size_; ++j) a.segments.push_back(static_cast<size_t>(j * output.numel()));
  a.shape.assign(input.sizes().begin(), input.sizes().end());
  OpChoice choice = reduce_op(opts.reduceOp, input, "reduce_scatter");
  a.op = choice.op;
  a.average = choice.average;
  auto work = bindings::engine_of(group_).reduce_scatter(a, keep({input, output}, group_), !opts.asyncOp);
  return complete(rank_, OpType::_REDUCE_SCATTER_BASE, group_, work, {output});
}

WorkRef ProcessGroupPycomm::reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& output = single(outputs, "reduce_scatter");
  TORCH_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_),
                    "pycomm backend: reduce_scatter needs one list of world_size (", size_, ") input tensors");
  std::vector<at::Tensor> flat_inputs;
  for (const auto& t : inputs[0]) {
    TORCH_CHECK_VALUE(t.numel() == output.numel() && t.scalar_type() == output.scalar_type(),
                      "pycomm backend: reduce_scatter inputs must have the output's size and dtype (", output.numel(),
                      " ", output.scalar_type(), "), got ", t.numel(), " ", t.scalar_type());
    flat_inputs.push_back(t.reshape({-1}));
  }
  at::Tensor flat = at::cat(flat_inputs);
  at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
  auto work = _reduce_scatter_base(out, flat, opts);
  if (out.is_same(output)) return work;
  at::Tensor dst = output;
  work->wait();
  dst.copy_(out);
  return work;
}

WorkRef ProcessGroupPycomm::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                         std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  ++seq_;
  bindings::SubmitScope submit;
  comm::AlltoallArgs a;
  a.input = buffer_of(input, "all_to_all_single");
  comm::Buffer out = buffer_of(output, "all_to_all_single");
  TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type() && output.device() == input.device(),
                    "pycomm backend: all_to_all_single output must have the input's dtype and device");
  TORCH_CHECK_VALUE(input.dim() >= 1 && output.dim() >= 1, "pycomm backend: all_to_all_single needs tensors with at "
                    "least one dimension");
  const int64_t row = input.numel() / std::max<int64_t>(input.size(0), 1);
  const int64_t out_row = output.numel() / std::max<int64_t>(output.size(0), 1);
  TORCH_CHECK_VALUE(input.size(0) == 0 || output.size(0) == 0 || row == out_row,
                    "pycomm backend: all_to_all_single input and output rows differ in size (", row, " vs ", out_row,
                    " elements)");
  auto splits = [&](std::vector<int64_t>& given, const at::Tensor& t, const char* which) {
    std::vector<size_t> rows;
    if (given.empty()) {
      TORCH_CHECK_VALUE(t.size(0) % size_ == 0, "pycomm backend: all_to_all_single without ", which,
                        "_split_sizes needs a first dimension divisible by the group size (", size_, "), got ",
                        t.size(0));
      rows.assign(static_cast<size_t>(size_), static_cast<size_t>(t.size(0) / size_));
      return rows;
    }
    TORCH_CHECK_VALUE(given.size() == static_cast<size_t>(size_), "pycomm backend: all_to_all_single ", which,
                      "_split_sizes needs ", size_, " entries, got ", given.size());
    int64_t total = 0;
    for (int64_t s : given) {
      TORCH_CHECK_VALUE(s >= 0, "pycomm backend: all_to_all_single ", which, "_split_sizes has a negative entry");
      total += s;
      rows.push_back(static_cast<size_t>(s));
    }
    TORCH_CHECK_VALUE(total == t.size(0), "pycomm backend: all_to_all_single ", which, "_split_sizes add up to ",
                      total, " but the ", which, " has ", t.size(0), " rows");
    return rows;
  };
  a.send_rows = splits(input_splits, input, "input");
  a.recv_rows = splits(output_splits, output, "output");
  a.row_elems = static_cast<size_t>(row);
  a.row_shape.assign(input.sizes().begin() + 1, input.sizes().end());
  a.output = out.data;
  auto work = bindings::engine_of(group_).alltoall(a, keep({input, output}, group_), !opts.asyncOp);
  return complete(rank_, OpType::ALLTOALL_BASE, group_, work, {output});
}

WorkRef ProcessGroupPycomm::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == static_cast<size_t>(size_) && inputs.size() == static_cast<size_t>(size_),
                    "pycomm backend: all_to_all needs world_size (", size_, ") input and output tensors");
  std::vector<at::Tensor> flat_in;
  std::vector<int64_t> in_splits, out_splits;
  int64_t out_total = 0;
  for (const auto& t : inputs) {
    flat_in.push_back(t.reshape({-1}));
    in_splits.push_back(t.numel());
  }
  for (const auto& t : outputs) {
    TORCH_CHECK_VALUE(t.scalar_type() == inputs[0].scalar_type(), "pycomm backend: all_to_all tensors must share a "
                      "dtype");
    out_splits.push_back(t.numel());
    out_total += t.numel();
  }
  at::Tensor in = at::cat(flat_in);
  at::Tensor out = at::empty({out_total}, in.options());
  auto work = alltoall_base(out, in, out_splits, in_splits, opts);
  auto inner = c10::static_intrusive_pointer_cast<PycommWork>(work);
  FutureRef future = make_future(outputs);
  std::vector<at::Tensor> outs = outputs;
  inner->getFuture()->addCallback([future, outs, out, out_splits](c10::ivalue::Future& f) {
    if (f.hasError()) return future->setError(f.exception_ptr());
    try {
      int64_t offset = 0;
      for (size_t i = 0; i < outs.size(); ++i) {
        outs[i].copy_(out.narrow(0, offset, out_splits[i]).view(outs[i].sizes()));
        offset += out_splits[i];
      }
    } catch (...) {
      return future->setError(std::current_exception());
    }
    future->markCompleted(c10::IValue(outs));
  });
  return c10::make_intrusive<PycommWork>(rank_, OpType::ALLTOALL, outs, future, group_);
}

WorkRef ProcessGroupPycomm::barrier(const c10d::BarrierOptions& opts) {
  ++seq_;
  auto work = bindings::engine_of(group_).barrier(!opts.asyncOp);
  return complete(rank_, OpType::BARRIER, group_, work, {});
}

namespace {
// The monitored barrier's messages on the point-to-point communicator: a tag user sends do not use
// (torch's send/recv tags are small non-negative numbers; MPI guarantees tags up to 32767).
constexpr int kMonitoredBarrierTag = 32767;

// Poll `req` until it completes or `deadline` passes; a request still open is cancelled. True if done.
bool wait_until(MPI_Request* req, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    int done = 0;
    PYCOMM_MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
    if (done) return true;
    if (std::chrono::steady_clock::now() >= deadline) {
      PYCOMM_MPI_CHECK(MPI_Cancel(req));
      PYCOMM_MPI_CHECK(MPI_Wait(req, MPI_STATUS_IGNORE));
      return false;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}
}  // namespace

void ProcessGroupPycomm::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  // Point-to-point on the backend's own communicator, not through the engine: a rank stuck in an
  // engine operation is exactly what this names.
  const auto timeout = opts.timeout == c10d::kUnsetTimeout ? std::chrono::milliseconds(30 * 60 * 1000) : opts.timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  char byte = 1;
  if (rank_ != 0) {
    PYCOMM_MPI_CHECK(MPI_Send(&byte, 1, MPI_CHAR, 0, kMonitoredBarrierTag, p2p_));
    MPI_Request ack;
    PYCOMM_MPI_CHECK(MPI_Irecv(&byte, 1, MPI_CHAR, 0, kMonitoredBarrierTag, p2p_, &ack));
    TORCH_CHECK(wait_until(&ack, deadline), "Rank ", rank_, " (pycomm backend): rank 0 did not release the ",
                "monitoredBarrier in ", timeout.count(), " ms; rank 0 names the ranks that did not arrive");
    return;
  }
  std::vector<MPI_Request> reqs(static_cast<size_t>(size_), MPI_REQUEST_NULL);
  std::vector<char> bytes(static_cast<size_t>(size_));
  for (int r = 1; r < size_; ++r)
    PYCOMM_MPI_CHECK(MPI_Irecv(&bytes[r], 1, MPI_CHAR, r, kMonitoredBarrierTag, p2p_, &reqs[r]));
  std::vector<int> late;
  for (int r = 1; r < size_; ++r) {
    // As gloo: rank 0's own time ran out before it came to wait for rank r.
    int arrived = 0;
    if (std::chrono::steady_clock::now() >= deadline) {
      PYCOMM_MPI_CHECK(MPI_Test(&reqs[r], &arrived, MPI_STATUS_IGNORE));
      if (!arrived) {
        for (int k = r; k < size_; ++k) wait_until(&reqs[k], deadline);  // cancels the open receives
        TORCH_CHECK(false, "Rank 0 timed out in monitoredBarrier after ", timeout.count(), " ms (pycomm backend); "
                    "rank ", r, " had not arrived");
      }
    }
    if (!arrived && !wait_until(&reqs[r], deadline)) late.push_back(r);
  }
  if (late.empty()) {
    for (int r = 1; r < size_; ++r) PYCOMM_MPI_CHECK(MPI_Send(&byte, 1, MPI_CHAR, r, kMonitoredBarrierTag, p2p_));
    return;
  }
  // gloo's wording, so that code matching gloo's message matches this one.
  std::ostringstream names;
  const size_t shown = waitAllRanks ? late.size() : 1;
  for (size_t i = 0; i < shown; ++i) names << (i ? ", " : "") << late[i];
  TORCH_CHECK(false, shown > 1 ? "Ranks " : "Rank ", names.str(), " failed to pass monitoredBarrier in ",
              timeout.count(), " ms (pycomm backend)");
}

namespace {
// Work whose future completes once `inner` has completed and `post` (copies into the caller's
// tensors, on the engine thread) has run.
WorkRef then_copy(int rank, OpType type, int64_t group, const WorkRef& inner, std::vector<at::Tensor> outs,
                  std::function<void()> post) {
  FutureRef future = make_future(outs);
  c10::static_intrusive_pointer_cast<PycommWork>(inner)->getFuture()->addCallback(
      [future, outs, post](c10::ivalue::Future& f) {
        if (f.hasError()) return future->setError(f.exception_ptr());
        try {
          post();
        } catch (...) {
          return future->setError(std::current_exception());
        }
        future->markCompleted(c10::IValue(outs));
      });
  return c10::make_intrusive<PycommWork>(rank, type, std::move(outs), future, group);
}

// The tensors of a coalesced call flattened into one buffer: one dtype and device, like gloo's.
at::Tensor flatten_all(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK_VALUE(!tensors.empty(), "pycomm backend: ", op, " needs at least one tensor");
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) {
    TORCH_CHECK_TYPE(t.scalar_type() == tensors[0].scalar_type() && t.device() == tensors[0].device(),
                     "pycomm backend: ", op, " needs tensors of one dtype and device, got ", tensors[0].scalar_type(),
                     " on ", tensors[0].device(), " and ", t.scalar_type(), " on ", t.device());
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, "pycomm backend: ", op, " supports dense tensors only");
    flat.push_back(t.reshape({-1}));
  }
  return at::cat(flat);
}
}  // namespace

WorkRef ProcessGroupPycomm::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceCoalescedOptions& opts) {
  at::Tensor flat = flatten_all(tensors, "allreduce_coalesced");
  std::vector<at::Tensor> flats{flat};
  c10d::AllreduceOptions o;
  o.reduceOp = opts.reduceOp;
  o.timeout = opts.timeout;
  o.asyncOp = opts.asyncOp;
  WorkRef inner = allreduce(flats, o);
  std::vector<at::Tensor> outs = tensors;
  return then_copy(rank_, OpType::ALLREDUCE_COALESCED, group_, inner, outs, [outs, flat] {
    int64_t offset = 0;
    for (const auto& t : outs) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  });
}

WorkRef ProcessGroupPycomm::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  // outputs[r][j] receives inputs[j] of rank r: one allgather of every input flattened together.
  at::Tensor in = flatten_all(inputs, "allgather_coalesced");
  TORCH_CHECK_VALUE(outputs.size() == static_cast<size_t>(size_), "pycomm backend: allgather_coalesced needs ",
                    size_, " output lists (one per rank), got ", outputs.size());
  for (const auto& list : outputs) {
    TORCH_CHECK_VALUE(list.size() == inputs.size(), "pycomm backend: allgather_coalesced output lists must hold ",
                      inputs.size(), " tensors (one per input), got ", list.size());
    for (size_t j = 0; j < list.size(); ++j)
      TORCH_CHECK_VALUE(list[j].numel() == inputs[j].numel() && list[j].scalar_type() == inputs[j].scalar_type(),
                        "pycomm backend: allgather_coalesced output ", j, " must match input ", j, " (",
                        inputs[j].numel(), " ", inputs[j].scalar_type(), "), got ", list[j].numel(), " ",
                        list[j].scalar_type());
  }
  at::Tensor flat = at::empty({size_ * in.numel()}, in.options());
  WorkRef inner = _allgather_base(flat, in, opts);
  std::vector<at::Tensor> outs;
  for (const auto& list : outputs) outs.insert(outs.end(), list.begin(), list.end());
  const int64_t total = in.numel();
  const size_t per_rank = inputs.size();
  return then_copy(rank_, OpType::ALLGATHER_COALESCED, group_, inner, outs, [outs, flat, total, per_rank] {
    for (size_t k = 0; k < outs.size(); ++k) {
      const int64_t r = static_cast<int64_t>(k / per_rank);
      int64_t offset = r * total;
      for (size_t j = k - k % per_rank; j < k; ++j) offset += outs[j].numel();
      outs[k].copy_(flat.narrow(0, offset, outs[k].numel()).view(outs[k].sizes()));
    }
  });
}

WorkRef ProcessGroupPycomm::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  bindings::SubmitScope submit;
  ++seq_;
  const at::Tensor& t = single(tensors, "reduce");
  comm::Buffer b = buffer_of(t, "reduce");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "pycomm backend: reduce root ", opts.rootRank,
                    " is not a rank of this group (0..", size_ - 1, ")");
  OpChoice choice = reduce_op(opts.reduceOp, t, "reduce");
  comm::Signature sig = signature(comm::Collective::REDUCE, t, "reduce");
  sig.op = static_cast<int32_t>(choice.op);
  sig.extra = choice.average ? 1 : 0;
  sig.root = static_cast<int32_t>(opts.rootRank);
  comm::Engine& engine = bindings::engine_of(group_);
  const int count = checked_count(b.count, "reduce");
  const int root = static_cast<int>(opts.rootRank), me = rank_, n = size_;
  MPI_Comm world = engine.topology().world;
  Kept kept = keep({t}, group_);
  KeptRef ref = kept;
  auto work = engine.submit_custom(sig, "reduce", "", kept, [=]() {
    // MPI_Reduce through MPI's (or pycomm's fp16/bf16) ops; device data via a host copy.
    const at::Tensor tensor = ref.lock()->at(0);
    at::Tensor h = host_view(tensor);
    const comm::DType dt = b.dtype;
    if (me == root) PYCOMM_MPI_CHECK(MPI_Reduce(MPI_IN_PLACE, h.data_ptr(), count, comm::mpi_datatype(dt),
                                                comm::mpi_op(dt, choice.op), root, world));
    else PYCOMM_MPI_CHECK(MPI_Reduce(h.data_ptr(), nullptr, count, comm::mpi_datatype(dt), comm::mpi_op(dt, choice.op),
                                     root, world));
    if (me == root) {
      if (choice.average) h.div_(n);
      if (!h.is_same(tensor)) tensor.copy_(h);
    }
  }, false);
  return complete(rank_, OpType::REDUCE, group_, work, {t});
}

WorkRef ProcessGroupPycomm::gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) {
  bindings::SubmitScope submit;
  ++seq_;
  const at::Tensor& input = single(inputs, "gather");
  buffer_of(input, "gather");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "pycomm backend: gather root ", opts.rootRank,
                    " is not a rank of this group (0..", size_ - 1, ")");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(size_),
                      "pycomm backend: gather needs one list of world_size (", size_, ") tensors on the root");
    for (const auto& o : outputs[0])
      TORCH_CHECK_VALUE(o.numel() == input.numel() && o.scalar_type() == input.scalar_type(),
                        "pycomm backend: gather outputs must have the input's size and dtype");
    outs = outputs[0];
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), "pycomm backend: gather takes outputs on the root only");
  }
  comm::Signature sig = signature(comm::Collective::GATHER, input, "gather");
  sig.root = root;
  comm::Engine& engine = bindings::engine_of(group_);
  const size_t bytes = static_cast<size_t>(input.numel()) * input.element_size();
  const int count = checked_count(bytes, "gather");
  checked_count(bytes * static_cast<size_t>(size_), "gather");
  const int me = rank_, n = size_;
  MPI_Comm world = engine.topology().world;
  std::vector<at::Tensor> tensors{input};
  tensors.insert(tensors.end(), outs.begin(), outs.end());  // the root's outputs after the input
  Kept kept = keep(std::move(tensors), group_);
  KeptRef ref = kept;
  auto work = engine.submit_custom(sig, "gather", "", kept, [=]() {
    const Kept k = ref.lock();
    const at::Tensor& in = (*k)[0];
    at::Tensor h = host_view(in);
    if (me != root) {
      PYCOMM_MPI_CHECK(MPI_Gather(h.data_ptr(), count, MPI_BYTE, nullptr, count, MPI_BYTE, root, world));
      return;
    }
    at::Tensor all = at::empty({static_cast<int64_t>(n) * in.numel()}, h.options());
    PYCOMM_MPI_CHECK(MPI_Gather(h.data_ptr(), count, MPI_BYTE, all.data_ptr(), count, MPI_BYTE, root, world));
    for (int i = 0; i < n; ++i) {
      at::Tensor& o = (*k)[1 + i];
      o.copy_(all.narrow(0, i * in.numel(), in.numel()).view(o.sizes()));
    }
  }, false);
  return complete(rank_, OpType::GATHER, group_, work, outs);
}

WorkRef ProcessGroupPycomm::scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) {
  bindings::SubmitScope submit;
  ++seq_;
  const at::Tensor& output = single(outputs, "scatter");
  buffer_of(output, "scatter");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "pycomm backend: scatter root ", opts.rootRank,
                    " is not a rank of this group (0..", size_ - 1, ")");
  const int root = static_cast<int>(opts.rootRank);
  // The root's inputs travel to the host on the engine thread, once their ready event has passed
  // (the engine waits on it before a non-fused operation runs): no synchronous copy at submit.
  std::vector<at::Tensor> kept_tensors{output};
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_),
                      "pycomm backend: scatter needs one list of world_size (", size_, ") tensors on the root");
    for (const auto& t : inputs[0]) {
      TORCH_CHECK_VALUE(t.numel() == output.numel() && t.scalar_type() == output.scalar_type(),
                        "pycomm backend: scatter inputs must have the output's size and dtype");
      kept_tensors.push_back(t);
    }
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), "pycomm backend: scatter takes inputs on the root only");
  }
  comm::Signature sig = signature(comm::Collective::SCATTER, output, "scatter");
  sig.root = root;
  comm::Engine& engine = bindings::engine_of(group_);
  const size_t bytes = static_cast<size_t>(output.numel()) * output.element_size();
  const int count = checked_count(bytes, "scatter");
  checked_count(bytes * static_cast<size_t>(size_), "scatter");
  MPI_Comm world = engine.topology().world;
  Kept kept = keep(std::move(kept_tensors), group_);
  KeptRef ref = kept;
  auto work = engine.submit_custom(sig, "scatter", "", kept, [=]() {
    const Kept k = ref.lock();
    const at::Tensor& out = (*k)[0];
    at::Tensor all;  // the root's inputs in rank order, on the host; undefined elsewhere
    if (k->size() > 1) {
      std::vector<at::Tensor> flat;
      for (size_t i = 1; i < k->size(); ++i) flat.push_back((*k)[i].reshape({-1}));
      all = at::cat(flat).to(at::kCPU);
    }
    at::Tensor h = out.is_cuda() ? at::empty(out.sizes(), out.options().device(at::kCPU)) : out;
    PYCOMM_MPI_CHECK(MPI_Scatter(all.defined() ? all.data_ptr() : nullptr, count, MPI_BYTE, h.data_ptr(), count,
                                 MPI_BYTE, root, world));
    if (!h.is_same(out)) out.copy_(h);
  }, false);
  return complete(rank_, OpType::SCATTER, group_, work, {output});
}

// ---------------------------------------------------------------- send / recv

namespace {
void check_tag(int tag, const char* op) {
  TORCH_CHECK_VALUE(tag >= 0 && tag <= 32767, "pycomm backend: ", op, " tag must be in 0..32767 (MPI's guaranteed "
                    "tag range), got ", tag);
}
}  // namespace

WorkRef ProcessGroupPycomm::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  const at::Tensor& t = single(tensors, "send");
  buffer_of(t, "send");
  check_tag(tag, "send");
  TORCH_CHECK_VALUE(dst >= 0 && dst < size_ && dst != rank_, "pycomm backend: send to rank ", dst,
                    ": not another rank of this group (0..", size_ - 1, ")");
  at::Tensor host = host_view(t);
  auto work = c10::make_intrusive<P2PWork>(rank_, OpType::SEND, t, host, false);
  PYCOMM_MPI_CHECK(MPI_Isend(host.data_ptr(), checked_count(host.nbytes(), "send"), MPI_BYTE, dst, tag, p2p_,
                             work->request()));
  return work;
}

WorkRef ProcessGroupPycomm::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  const at::Tensor& t = single(tensors, "recv");
  buffer_of(t, "recv");
  check_tag(tag, "recv");
  TORCH_CHECK_VALUE(src >= 0 && src < size_ && src != rank_, "pycomm backend: recv from rank ", src,
                    ": not another rank of this group (0..", size_ - 1, ")");
  at::Tensor host = t.is_cuda() ? at::empty(t.sizes(), t.options().device(at::kCPU)) : t;
  auto work = c10::make_intrusive<P2PWork>(rank_, OpType::RECV, t, host, t.is_cuda());
  PYCOMM_MPI_CHECK(MPI_Irecv(host.data_ptr(), checked_count(host.nbytes(), "recv"), MPI_BYTE, src, tag, p2p_,
                             work->request()));
  return work;
}

WorkRef ProcessGroupPycomm::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const at::Tensor& t = single(tensors, "recv");
  buffer_of(t, "recv");
  check_tag(tag, "recv");
  at::Tensor host = t.is_cuda() ? at::empty(t.sizes(), t.options().device(at::kCPU)) : t;
  auto work = c10::make_intrusive<P2PWork>(rank_, OpType::RECVANYSOURCE, t, host, t.is_cuda());
  PYCOMM_MPI_CHECK(MPI_Irecv(host.data_ptr(), checked_count(host.nbytes(), "recv"), MPI_BYTE, MPI_ANY_SOURCE, tag,
                             p2p_, work->request()));
  return work;
}

}  // namespace c10d_backend
}  // namespace pycomm
