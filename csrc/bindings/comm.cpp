#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "../comm/algorithms.h"
#include "../comm/device_event.h"
#include "../comm/engine.h"
#include "../comm/memory_mover.h"
#include "../comm/window_copy.h"
#include "bindings.h"
#ifdef PYCOMM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;

namespace pycomm {
namespace bindings {
namespace {
// One engine per group, each on its group's own communicators: group 0 is the world (pycomm/runtime.py),
// the others are process groups (pycomm/groups.py). All start and stop through engine_start/engine_stop.
std::map<int64_t, std::unique_ptr<comm::Engine>> g_engines;
std::mutex g_engine_mu;
}  // namespace

comm::Engine& engine() { return engine_of(0); }

comm::Engine& engine_of(int64_t group) {
  auto it = g_engines.find(group);
  if (it != g_engines.end()) return *it->second;
  if (group == 0) throw comm::CommError("pycomm is not initialized: call pycomm.init() first");
  throw comm::CommError("pycomm process group " + std::to_string(group) + " is not running (destroyed, or this "
                        "rank is not a member)");
}

namespace {

comm::ReduceOp parse_op(const std::string& op) {
  if (op == "sum") return comm::ReduceOp::SUM;
  if (op == "min") return comm::ReduceOp::MIN;
  if (op == "max") return comm::ReduceOp::MAX;
  if (op == "prod") return comm::ReduceOp::PROD;
  throw py::value_error("unknown reduction op '" + op + "'; choose sum, avg, min or max");
}

// pycomm's op="avg" is for floating-point tensors (collectives.py's check, with the user's message);
// refused here too, so the Python fast paths that call straight in need no check of their own.
bool check_average(bool average, kernels::DType dtype) {
  if (average && !kernels::is_floating(dtype)) throw py::type_error("allreduce: an average needs a floating-point tensor");
  return average;
}

// The catalogue's parse, with an unknown name a ValueError as for every other bad argument.
comm::Algorithm parse_algorithm(const std::string& a) {
  try {
    return comm::parse_algorithm(a);
  } catch (const comm::CommError& e) {
    throw py::value_error(e.what());
  }
}

comm::EngineOptions options_from(const py::dict& d, comm::EngineOptions o) {
  if (d.contains("ring_chunk_bytes")) o.ring_chunk_bytes = d["ring_chunk_bytes"].cast<size_t>();
  if (d.contains("shm_chunk_bytes")) o.shm_chunk_bytes = d["shm_chunk_bytes"].cast<size_t>();
  if (d.contains("auto_ring_min_bytes")) o.auto_ring_min_bytes = d["auto_ring_min_bytes"].cast<size_t>();
  if (d.contains("check_consistency")) o.check_consistency = d["check_consistency"].cast<bool>();
  if (d.contains("fusion_threshold_bytes")) o.fusion_threshold_bytes = d["fusion_threshold_bytes"].cast<size_t>();
  if (d.contains("cycle_time_ms")) o.cycle_time_ms = d["cycle_time_ms"].cast<double>();
  if (d.contains("stall_warning_s")) o.stall.warning_s = d["stall_warning_s"].cast<double>();
  if (d.contains("stall_abort_s")) o.stall.abort_s = d["stall_abort_s"].cast<double>();
  if (d.contains("staging_chunk_bytes")) o.staging_chunk_bytes = d["staging_chunk_bytes"].cast<size_t>();
  if (d.contains("force_staging")) o.force_staging = d["force_staging"].cast<bool>();
  if (d.contains("force_device_direct")) o.force_device_direct = d["force_device_direct"].cast<bool>();
  if (d.contains("peer_path")) o.peer_path = d["peer_path"].cast<bool>();
  if (d.contains("force_peer")) o.force_peer = d["force_peer"].cast<bool>();
  if (d.contains("peer_chunk_bytes")) o.peer_chunk_bytes = d["peer_chunk_bytes"].cast<size_t>();
  if (d.contains("pair_by_name")) o.pair_by_name = d["pair_by_name"].cast<bool>();
  if (d.contains("auto_table")) {
    o.auto_table.clear();
    for (auto item : d["auto_table"].cast<py::list>()) {
      auto pair = item.cast<py::tuple>();
      o.auto_table.emplace_back(pair[0].cast<size_t>(), parse_algorithm(pair[1].cast<std::string>()));
    }
    std::sort(o.auto_table.begin(), o.auto_table.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
  }
  return o;
}

py::dict options_to(const comm::EngineOptions& o) {
  py::dict d;
  d["ring_chunk_bytes"] = o.ring_chunk_bytes;
  d["shm_chunk_bytes"] = o.shm_chunk_bytes;
  d["auto_ring_min_bytes"] = o.auto_ring_min_bytes;
  d["check_consistency"] = o.check_consistency;
  d["fusion_threshold_bytes"] = o.fusion_threshold_bytes;
  d["cycle_time_ms"] = o.cycle_time_ms;
  d["stall_warning_s"] = o.stall.warning_s;
  d["stall_abort_s"] = o.stall.abort_s;
  d["staging_chunk_bytes"] = o.staging_chunk_bytes;
  d["force_staging"] = o.force_staging;
  d["force_device_direct"] = o.force_device_direct;
  d["peer_path"] = o.peer_path;
  d["force_peer"] = o.force_peer;
  d["peer_chunk_bytes"] = o.peer_chunk_bytes;
  d["pair_by_name"] = o.pair_by_name;
  py::list table;
  for (const auto& e : o.auto_table) table.append(py::make_tuple(e.first, comm::algorithm_name(e.second)));
  d["auto_table"] = table;
  return d;
}

}  // namespace

// torch's current stream on CUDA device `device` (a cudaStream_t); nullptr for the host stand-in.
void* current_stream(int device) {
#ifdef PYCOMM_WITH_CUDA
  if (device >= 0) return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#endif
  (void)device;
  return nullptr;
}

namespace {

// The output of allgather/alltoall, allocated on the engine thread once the row counts are known. A
// CUDA output is allocated with the submitter's current stream (captured here) current, so torch's
// caching allocator ties the block to the stream that uses it (after wait() orders that stream on
// the engine's done event), never to the engine thread's default stream (docs/gpu.md).
std::function<at::Tensor(int64_t)> output_allocator(const at::TensorOptions& options) {
#ifdef PYCOMM_WITH_CUDA
  if (options.device().is_cuda()) {
    c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(options.device().index());
    return [options, stream](int64_t numel) {
      c10::cuda::CUDAStreamGuard guard(stream);  // also the device, given back after
      return at::empty({numel}, options);
    };
  }
#endif
  return [options](int64_t numel) { return at::empty({numel}, options); };
}

}  // namespace

namespace {
template <class T>
void divide_elements(T* p, int64_t count, T n) {
  for (int64_t i = 0; i < count; ++i) p[i] /= n;  // vectorized by the compiler; still IEEE division
}
}  // namespace

void divide_in_place(at::Tensor& t, int64_t n, bool block_host) {
  // Small host tensors (most gradients of a latency-bound step) divide here, without the dispatcher's
  // microsecond; large ones through ATen, which splits the work over its threads.
  constexpr int64_t kInlineElements = 1 << 16;
  if (t.is_cpu() && t.is_contiguous() && t.numel() <= kInlineElements) {
    if (t.scalar_type() == at::kFloat) return divide_elements(t.data_ptr<float>(), t.numel(), static_cast<float>(n));
    if (t.scalar_type() == at::kDouble) return divide_elements(t.data_ptr<double>(), t.numel(), static_cast<double>(n));
  }
  t.detach().div_(n);  // detached: a leaf that requires grad is written without autograd, as Horovod does
#ifdef PYCOMM_WITH_CUDA
  if (block_host && t.is_cuda())
    c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(t.get_device())).synchronize();
#else
  (void)block_host;
#endif
}

// The caller is about to wait for `work`: nothing queued is held back for a fusion cycle any more
// (the last partial batch of a step runs at once), and a batch the worker has not taken runs on the
// caller's thread (Engine::run_queued_for), as the c10d backend's wait() does. Without the GIL.
void run_before_waiting(const comm::Work& work, int64_t group) {
  if (group < 0 || work.done()) return;
  try {
    engine_of(group).run_queued_for(work);
  } catch (const comm::CommError&) {  // the engine is gone: wait() reports the operation's own error
  }
}

// pycomm's lanes use a CUDA tensor after the engine has finished issuing work on it (the host does
// not wait for the last copies): recorded on both lanes, torch's caching allocator does not hand
// its memory out again before that work has run (docs/gpu.md, stream rules).
namespace {
void record_on_lanes(const at::Tensor& t, comm::Engine& engine) {
#ifdef PYCOMM_WITH_CUDA
  const auto lanes = engine.executor().device_lanes(t.get_device());
  for (void* s : {lanes.first, lanes.second})
    if (s)
      t.record_stream(c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(s),
                                                       static_cast<c10::DeviceIndex>(t.get_device())));
#else
  (void)t;
  (void)engine;
#endif
}
}  // namespace

// The tensors of one submission, kept alive until the engine is done, and
// its ready event (device_event.h): recorded on torch's current stream of the
// tensors' device, which produced them; the engine waits on it before it
// touches the memory, and this thread goes on (no host block). Host tensors
// under the device stand-ins (force_staging / force_device_direct) get the
// stand-in's event, so the same control flow runs on CPU machines; other host
// tensors get none.
std::shared_ptr<std::vector<at::Tensor>> keep(std::vector<at::Tensor> tensors, comm::Engine& engine) {
  comm::EventPtr ready;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    if (t.is_cuda()) {
      if (ready && ready->device() != t.get_device())
        throw py::value_error("pycomm: the tensors of one call are on different devices (cuda:" +
                              std::to_string(ready->device()) + " and cuda:" + std::to_string(t.get_device()) +
                              "); move them to one device");
      if (!ready) ready = comm::record_cuda_event(t.get_device(), current_stream(t.get_device()));
      record_on_lanes(t, engine);
    }
  }
  if (!ready && engine.device_standin()) ready = comm::record_host_event();
  comm::set_submit_event(std::move(ready));
  return std::make_shared<std::vector<at::Tensor>>(std::move(tensors));
}

namespace {

// An asynchronous submission keeps the GIL unless the engine's queue lock is busy (Engine::SubmitterHold).
struct ReleaseGilIfWaiting final : comm::Engine::SubmitterHold {
  std::optional<py::gil_scoped_release> released;
  void release() override { released.emplace(); }
};

}  // namespace

std::shared_ptr<Handle> allreduce_async(const at::Tensor& input, const at::Tensor& output, const std::string& op,
                                        bool average, const std::string& algorithm, const std::string& name,
                                        bool blocking, int64_t group, int64_t divide_by) {
  SubmitScope submit;
  comm::AllreduceArgs a;
  const bool in_place = input.is_same(output);
  a.input = to_buffer(input, "allreduce");
  a.output = in_place ? a.input : to_buffer(output, "allreduce out");
  if (a.input.count != a.output.count || a.input.dtype != a.output.dtype)
    throw py::value_error("allreduce: out must have the input's shape and dtype");
  a.op = parse_op(op);
  a.average = check_average(average, a.input.dtype);
  if (divide_by != 1 && (divide_by < 1 || a.op != comm::ReduceOp::SUM || average ||
                         (a.output.dtype != kernels::DType::F32 && a.output.dtype != kernels::DType::F64)))
    throw py::value_error("allreduce: divide_by (" + std::to_string(divide_by) + ") divides the sum of a float32 or "
                          "float64 tensor by a positive count; use op='sum' without average");
  a.algorithm = parse_algorithm(algorithm);
  a.name = name;
  a.shape = input.sizes().vec();
  comm::Engine& engine = engine_of(group);
  auto kept = in_place ? keep({input}, engine) : keep({input, output}, engine);
  comm::WorkPtr work;
  if (blocking) {
    py::gil_scoped_release release;  // the collective may run right here
    work = engine.allreduce(std::move(a), std::move(kept), true);
  } else {
    ReleaseGilIfWaiting gil;  // taken again at the end of this block if it was let go
    work = engine.allreduce(std::move(a), std::move(kept), false, &gil);
  }
  auto handle = std::make_shared<Handle>(std::move(work), output, group);
  if (divide_by > 1) handle->divide_result_by(divide_by);
  return handle;
}

namespace {

// pycomm.grouped_allreduce: the allreduces of a list of tensors in one submission.
class GroupHandle {
 public:
  GroupHandle(std::vector<comm::WorkPtr> works, std::vector<at::Tensor> results, int64_t group)
      : works_(std::move(works)), results_(std::move(results)), group_(group) {}

  // Every allreduce of the group has finished (the first error, if any, is raised after all have);
  // CUDA results are ordered on the current stream as Handle.wait() orders them.
  py::list wait() {
    finish(false);
    return results();
  }
  py::list synchronize() {
    finish(true);
    return results();
  }
  bool done() const {
    return std::all_of(works_.begin(), works_.end(), [](const comm::WorkPtr& w) { return w->done(); });
  }
  size_t size() const { return works_.size(); }

 private:
  void finish(bool block_host) {
    py::gil_scoped_release release;
    std::exception_ptr first;
    for (const comm::WorkPtr& w : works_) {
      // A group above the fusion limits runs in several batches: each is flushed as the caller reaches it.
      run_before_waiting(*w, group_);
      try {
        w->wait();
      } catch (...) {
        if (!first) first = std::current_exception();
        continue;
      }
      if (comm::EventPtr e = w->done_event()) {
        if (block_host) e->synchronize();
        else order_current_stream(e);
      }
    }
    if (first) std::rethrow_exception(first);
  }
  py::list results() const {
    py::list out;
    for (const at::Tensor& t : results_) out.append(t);
    return out;
  }

  std::vector<comm::WorkPtr> works_;
  std::vector<at::Tensor> results_;
  int64_t group_ = 0;
};

// `names` empty: every tensor unnamed; else one name per tensor. The checks of collectives.py come first.
std::shared_ptr<GroupHandle> grouped_allreduce_async(const std::vector<at::Tensor>& inputs,
                                                     const std::vector<at::Tensor>& outputs, const std::string& op,
                                                     bool average, const std::string& algorithm,
                                                     const std::vector<std::string>& names, bool blocking,
                                                     int64_t group) {
  if (outputs.size() != inputs.size())
    throw py::value_error("grouped_allreduce: give one output per input (" + std::to_string(inputs.size()) + ")");
  if (!names.empty() && names.size() != inputs.size())
    throw py::value_error("grouped_allreduce: give one name per tensor (" + std::to_string(inputs.size()) + ")");
  SubmitScope submit;
  const comm::ReduceOp reduce = parse_op(op);
  const comm::Algorithm algo = parse_algorithm(algorithm);
  std::vector<comm::AllreduceArgs> args(inputs.size());
  std::vector<at::Tensor> kept;
  kept.reserve(2 * inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    comm::AllreduceArgs& a = args[i];
    a.input = to_buffer(inputs[i], "grouped_allreduce");
    a.output = to_buffer(outputs[i], "grouped_allreduce out");
    if (a.input.count != a.output.count || a.input.dtype != a.output.dtype)
      throw py::value_error("grouped_allreduce: out[" + std::to_string(i) + "] must have the input's shape and dtype");
    a.op = reduce;
    a.average = average;
    a.algorithm = algo;
    if (!names.empty()) a.name = names[i];
    a.shape = inputs[i].sizes().vec();
    kept.push_back(inputs[i]);
    if (!outputs[i].is_same(inputs[i])) kept.push_back(outputs[i]);
  }
  comm::Engine& e = engine_of(group);
  std::shared_ptr<void> keepalive = keep(std::move(kept), e);  // one ready event for the group
  std::vector<comm::WorkPtr> works;
  {
    py::gil_scoped_release release;
    works = e.allreduce_group(args, std::move(keepalive), blocking);
  }
  return std::make_shared<GroupHandle>(std::move(works), outputs, group);
}

// pycomm.allreduce's fast path (collectives.py, after its checks): a blocking
// in-place allreduce on the world that returns the tensor itself -- no Handle,
// no keepalive (the caller's reference outlives the call).
at::Tensor allreduce_blocking(const at::Tensor& tensor, const std::string& op, bool average,
                              const std::string& algorithm, const std::string& name) {
  comm::AllreduceArgs a;
  a.input = a.output = to_buffer(tensor, "allreduce");
  a.op = parse_op(op);
  a.average = check_average(average, a.input.dtype);
  a.algorithm = parse_algorithm(algorithm);
  a.name = name;
  a.shape = tensor.sizes().vec();
  SubmitScope submit;
  // Device memory and the device stand-ins need keep()'s ready event; a plain host tensor needs nothing.
  std::shared_ptr<void> kept;
  if (tensor.is_cuda() || engine().device_standin()) kept = keep({tensor}, engine());
  {
    py::gil_scoped_release release;
    comm::WorkPtr work = engine().allreduce(std::move(a), std::move(kept), true);
    work->wait();
    order_current_stream(work->done_event());  // the caller's stream after pycomm's device work
  }
  return tensor;
}

std::shared_ptr<Handle> broadcast_async(const at::Tensor& tensor, int root, const std::string& name, bool blocking,
                                        int64_t group = 0) {
  SubmitScope submit;
  comm::Buffer b = to_buffer(tensor, "broadcast");
  comm::WorkPtr work;
  {
    py::gil_scoped_release release;
    work = engine_of(group).broadcast(b, root, name, keep({tensor}, engine_of(group)), blocking);
  }
  return std::make_shared<Handle>(work, tensor);
}

std::shared_ptr<Handle> allgather_async(const at::Tensor& tensor, const std::string& name, int64_t group = 0) {
  SubmitScope submit;
  if (tensor.dim() == 0) throw py::value_error("allgather: tensor needs at least one dimension");
  comm::Buffer b = to_buffer(tensor, "allgather");
  auto gathered = std::make_shared<Handle::Gathered>();
  gathered->row_shape.assign(tensor.sizes().begin() + 1, tensor.sizes().end());
  int64_t row_numel = 1;
  for (int64_t d : gathered->row_shape) row_numel *= d;
  auto make = output_allocator(tensor.options());
  auto allocate = [gathered, make, row_numel](size_t rows) -> void* {
    gathered->rows = static_cast<int64_t>(rows);
    gathered->flat = make(gathered->rows * row_numel);
    return gathered->flat.data_ptr();
  };
  auto work = engine_of(group).allgather(b, static_cast<size_t>(tensor.size(0)), gathered->row_shape, allocate, name,
                                 keep({tensor}, engine_of(group)));
  auto handle = std::make_shared<Handle>(work, at::Tensor());
  handle->gathered = gathered;
  return handle;
}

// reduce_scatter: `output` holds this rank's segment of `input` split along
// dim 0 into `rows[j]` rows for rank j.
std::shared_ptr<Handle> reduce_scatter_async(const at::Tensor& input, const at::Tensor& output,
                                             const std::vector<int64_t>& rows, const std::string& op, bool average,
                                             const std::string& algorithm, const std::string& name, bool blocking,
                                             int64_t group) {
  SubmitScope submit;
  comm::ReduceScatterArgs a;
  a.input = to_buffer(input, "reduce_scatter");
  a.output = to_buffer(output, "reduce_scatter out");
  if (input.device() != output.device()) throw py::value_error("reduce_scatter: out must be on the input's device");
  const int64_t row_numel = input.dim() == 0 || input.size(0) == 0 ? 0 : input.numel() / input.size(0);
  a.segments.push_back(0);
  for (int64_t r : rows) a.segments.push_back(a.segments.back() + static_cast<size_t>(r * row_numel));
  a.shape.assign(input.sizes().begin(), input.sizes().end());
  a.op = parse_op(op);
  a.average = average;
  a.algorithm = parse_algorithm(algorithm);
  a.name = name;
  a.shape = input.sizes().vec();
  comm::WorkPtr work;
  {
    py::gil_scoped_release release;
    work = engine_of(group).reduce_scatter(a, keep({input, output}, engine_of(group)), blocking);
  }
  return std::make_shared<Handle>(work, output);
}

// alltoall: `splits[j]` rows of `input` go to rank j; the output (rows from
// every rank, in rank order) is allocated once the counts are known.
std::shared_ptr<Handle> alltoall_async(const at::Tensor& input, const std::vector<int64_t>& splits,
                                       const std::string& name, bool blocking, int64_t group) {
  SubmitScope submit;
  if (input.dim() == 0) throw py::value_error("alltoall: tensor needs at least one dimension");
  comm::AlltoallArgs a;
  a.input = to_buffer(input, "alltoall");
  a.row_shape.assign(input.sizes().begin() + 1, input.sizes().end());
  int64_t row_numel = 1;
  for (int64_t d : a.row_shape) row_numel *= d;
  a.row_elems = static_cast<size_t>(row_numel);
  for (int64_t s : splits) a.send_rows.push_back(static_cast<size_t>(s));
  a.name = name;
  auto gathered = std::make_shared<Handle::Gathered>();
  gathered->row_shape = a.row_shape;
  auto make = output_allocator(input.options());
  a.allocate = [gathered, make, row_numel](size_t rows) -> void* {
    gathered->rows = static_cast<int64_t>(rows);
    gathered->flat = make(gathered->rows * row_numel);
    return gathered->flat.data_ptr();
  };
  comm::WorkPtr work;
  {
    py::gil_scoped_release release;
    work = engine_of(group).alltoall(a, keep({input}, engine_of(group)), blocking);
  }
  auto handle = std::make_shared<Handle>(work, at::Tensor());
  handle->gathered = gathered;
  return handle;
}

}  // namespace

// Group 0 takes `options`; a process group, the world engine's options at its creation.
void start_engine(int64_t group, const comm::Topology& t, MPI_Comm control, bool homogeneous,
                  const py::object& options) {
  std::lock_guard<std::mutex> lock(g_engine_mu);
  if (group < 0) throw comm::CommError("pycomm engine ids are 0 (the world) and process group ids from 1");
  if (g_engines.count(group))
    throw comm::CommError(group == 0 ? std::string("pycomm engine already started")
                                     : "pycomm process group " + std::to_string(group) + " exists");
  comm::EngineOptions o;
  if (group == 0) {
    o = options.is_none() ? comm::EngineOptions() : options_from(options.cast<py::dict>(), comm::EngineOptions());
  } else {
    auto world = g_engines.find(0);
    if (world == g_engines.end()) throw comm::CommError("pycomm is not initialized: call pycomm.init() first");
    o = world->second->options();
  }
  g_engines[group] = std::make_unique<comm::Engine>(t, control, homogeneous, o);
}

// Finish the queued operations of `group`'s engine and stop it; group < 0: every engine, the process
// groups' first (they share the world's MPI types).
void stop_engines(int64_t group) {
  std::vector<std::unique_ptr<comm::Engine>> stopping;
  {
    std::lock_guard<std::mutex> lock(g_engine_mu);
    for (auto it = g_engines.rbegin(); it != g_engines.rend(); ++it)  // descending ids: the world last
      if (group < 0 || it->first == group) stopping.push_back(std::move(it->second));
    if (group < 0) g_engines.clear();
    else g_engines.erase(group);
  }
  for (auto& e : stopping) e.reset();  // drains the queue, joins the worker
}

namespace {
comm::Topology topology_from(int64_t world, int64_t local, int64_t cross, int rank, int size, int local_rank,
                             int local_size, int node_rank, int num_nodes) {
  comm::Topology t;
  t.world = MPI_Comm_f2c(static_cast<MPI_Fint>(world));
  t.local = MPI_Comm_f2c(static_cast<MPI_Fint>(local));
  t.cross = MPI_Comm_f2c(static_cast<MPI_Fint>(cross));
  t.rank = rank;
  t.size = size;
  t.local_rank = local_rank;
  t.local_size = local_size;
  t.node_rank = node_rank;
  t.num_nodes = num_nodes;
  return t;
}
}  // namespace

void register_comm_ops(py::module_& m) {
  m.def("reduce_scatter_async", &reduce_scatter_async, py::arg("input"), py::arg("output"), py::arg("rows"),
        py::arg("op"), py::arg("average"), py::arg("algorithm") = "auto", py::arg("name") = "",
        py::arg("blocking") = false, py::arg("group") = 0);
  m.def("alltoall_async", &alltoall_async, py::arg("input"), py::arg("splits"), py::arg("name") = "",
        py::arg("blocking") = false, py::arg("group") = 0);
  m.def("group_set_options", [](int64_t group, const py::dict& d) {
    engine_of(group).set_options(options_from(d, engine_of(group).options()));
  });
}

void register_comm(py::module_& m) {
  static py::exception<comm::CommError> comm_error(m, "CommError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const comm::CommError& e) {
      py::set_error(comm_error, e.what());
    }
  });

  register_handle(m);  // handle.cpp: pycomm.Handle, a plain CPython type

  py::class_<GroupHandle, std::shared_ptr<GroupHandle>>(m, "GroupHandle",
                                                         "The allreduces of a grouped_allreduce in flight.")
      .def("wait", &GroupHandle::wait,
           "Wait until every allreduce of the group has finished (GIL released) and return the list of results; "
           "CUDA results are ordered on the current stream as Handle.wait() orders them.")
      .def("synchronize", &GroupHandle::synchronize,
           "wait(), then block the host until pycomm's device work on the results has finished.")
      .def("done", &GroupHandle::done, "True once every allreduce of the group has finished.")
      .def("__len__", &GroupHandle::size)
      .def("__repr__", [](const GroupHandle& h) {
        return "<pycomm.GroupHandle of " + std::to_string(h.size()) + " allreduces" +
               (h.done() ? " done>" : " pending>");
      });

  m.def(
      "engine_start",
      [](int64_t group, int64_t world, int64_t local, int64_t cross, int64_t control, int rank, int size,
         int local_rank, int local_size, int node_rank, int num_nodes, bool homogeneous, const py::object& options) {
        start_engine(group, topology_from(world, local, cross, rank, size, local_rank, local_size, node_rank, num_nodes),
                     MPI_Comm_f2c(static_cast<MPI_Fint>(control)), homogeneous, options);
      },
      py::arg("group"), py::arg("world"), py::arg("local"), py::arg("cross"), py::arg("control"), py::arg("rank"),
      py::arg("size"), py::arg("local_rank"), py::arg("local_size"), py::arg("node_rank"), py::arg("num_nodes"),
      py::arg("homogeneous"), py::arg("options") = py::none(),
      "Start the engine of `group` (0: the world, with `options`; a process group takes the world engine's) on "
      "its communicators, given as Fortran handles (mpi4py's Comm.py2f()).");
  m.def(
      "engine_stop",
      [](int64_t group) {
        py::gil_scoped_release release;
        stop_engines(group);
      },
      py::arg("group") = -1,
      "Finish the queued operations of `group`'s engine and stop it; without a group, every engine (the world's "
      "last).");
  m.def("engine_running", [] {
    std::lock_guard<std::mutex> lock(g_engine_mu);
    return g_engines.count(0) > 0;
  });
  m.def("mpi_cuda_aware", [] { return comm::mpi_is_cuda_aware(); },
        "Whether MPI reads CUDA device memory itself (else device data is staged through pinned host buffers).");
  m.def("mpi_library_cuda_support", [] { return comm::mpi_library_cuda_support(); },
        "What the MPI library says of itself: 1 CUDA-aware, 0 built without CUDA, -1 it cannot tell.");
  m.def("_direct_path_refusal",
        [](const std::string& what, bool cuda_aware, bool forced_direct, int library_support,
           const std::string& env_override) {
          return comm::direct_path_refusal(what, cuda_aware, forced_direct, library_support,
                                           env_override.empty() ? nullptr : env_override.c_str());
        },
        "The engine's guard before CUDA device pointers go to MPI (memory_mover.h): the reason, or ''.");
  m.def("set_options", [](const py::dict& d) {
    comm::EngineOptions o = options_from(d, engine().options());
    py::gil_scoped_release release;  // queued behind earlier operations, agreed by every rank
    engine().set_options(o);
  });
  m.def("get_options", [] { return options_to(engine().options()); });
  m.def("peer_verdict", [] { return engine().executor().peer_verdict(); },
        "The peer path's verdict (executor.h): '' not probed yet, 'peer: <memory>' or 'staged: <why not>'.");
  m.def("stats", [] {
    auto s = engine().stats();
    py::dict d;
    d["operations"] = s.operations;
    d["rounds"] = s.rounds;
    d["fused_tensors"] = s.fused_tensors;
    d["waiter_batches"] = s.waiter_batches;
    d["shm_allocations"] = s.shm_allocations;
    d["shm_segment_bytes"] = s.shm_segment_bytes;
    d["fusion_buffer_bytes"] = s.fusion_buffer_bytes;
    d["staging_bytes"] = s.staging_bytes;
    d["device_cache_bytes"] = s.device_cache_bytes;
    d["device_cache_allocations"] = s.device_cache_allocations;
    d["device_fusion_bytes"] = s.device_fusion_bytes;
    d["compressed_cache_bytes"] = s.compressed_cache_bytes;
    d["compressed_cache_allocations"] = s.compressed_cache_allocations;
    d["device_fusion_allocations"] = s.device_fusion_allocations;
    d["peer_block_bytes"] = s.peer_block_bytes;
    d["peer_allocations"] = s.peer_allocations;
    d["peer_allreduces"] = s.peer_allreduces;
    d["ready_waits"] = s.ready_waits;
    d["done_events"] = s.done_events;
    const comm::EventCounters ev = comm::event_counters();
    d["events_created"] = ev.created;
    d["events_recorded"] = ev.recorded;
    d["event_stream_waits"] = ev.stream_waits;
    d["event_host_waits"] = ev.host_waits;
    return d;
  });
  m.def("allreduce_algorithms", [] {
    py::list out;
    for (const auto& e : comm::allreduce_algorithms()) {
      py::dict d;
      d["name"] = e.name;
      d["phase"] = e.phase;
      d["summary"] = e.summary;
      d["one_node"] = e.one_node;
      d["equal_nodes"] = e.equal_nodes;
      d["across_nodes"] = e.across_nodes;
      d["window_fusion"] = e.fusion == comm::WindowFusion::NONE    ? "none"
                           : e.fusion == comm::WindowFusion::LOCAL ? "local"
                                                                   : "cross";
      d["device"] = e.device != nullptr;
      out.append(d);
    }
    return out;
  }, "The allreduce algorithms of the catalogue ('auto' excluded), in wire order, as dicts.");
  m.def("allreduce_offered", [](int size, int num_nodes, int local_size, bool homogeneous) {
    py::list out;
    for (comm::Algorithm a : comm::allreduce_offered(comm::JobShape{size, num_nodes, local_size, homogeneous}))
      out.append(comm::algorithm_name(a));
    return out;
  }, py::arg("size"), py::arg("num_nodes"), py::arg("local_size"), py::arg("homogeneous"),
     "The algorithms worth timing or modelling on a job of this shape.");
  m.def("allreduce_refusal", [](const std::string& algorithm, int size, int num_nodes, int local_size,
                                bool homogeneous) {
    const comm::Algorithm a = parse_algorithm(algorithm);
    if (a == comm::Algorithm::AUTO) return std::string();
    return comm::allreduce_refusal(a, comm::JobShape{size, num_nodes, local_size, homogeneous});
  }, py::arg("algorithm"), py::arg("size"), py::arg("num_nodes"), py::arg("local_size"), py::arg("homogeneous"),
     "Why `algorithm` cannot run on a job of this shape, or '' when it can.");
  m.def("resolve_algorithm", [](const std::string& algorithm, size_t bytes) {
    return std::string(comm::algorithm_name(engine().executor().resolve(parse_algorithm(algorithm), bytes, engine().options())));
  }, "The algorithm that `algorithm` (e.g. 'auto') means for a message of `bytes` on this topology.");

  m.def("allreduce_async", &allreduce_async, py::arg("input"), py::arg("output"), py::arg("op"), py::arg("average"),
        py::arg("algorithm"), py::arg("name") = "", py::arg("blocking") = false, py::arg("group") = 0,
        py::arg("divide_by") = 1,
        "The checked allreduce submission. divide_by > 1: the float32/float64 sum is divided by it when the "
        "result is first waited for (pycomm.horovod's Average).");
  m.def("set_window_stores", [](const std::string& name) {
    try {
      comm::window_copy::set_stores(comm::window_copy::parse_stores(name));
    } catch (const comm::CommError& e) {
      throw py::value_error(e.what());
    }
  }, py::arg("stores"),
     "How this process copies into the shm window: 'auto' (measured, per engine thread; the default), "
     "'cached' or 'streaming' (comm/window_copy.h).");
  m.def("window_copy_totals", [] {
    const comm::window_copy::Totals t = comm::window_copy::totals();
    py::dict d;
    d["cached_bytes"] = t.cached_bytes;
    d["streamed_bytes"] = t.streamed_bytes;
    d["switches"] = t.switches;
    return d;
  }, "Bytes this process has copied into the shm window with ordinary and with streaming stores, and the "
     "changes of method 'auto' has made.");
  m.def("shm_pipeline_min_bytes", &comm::shm_pipeline_min_bytes, py::arg("local_size"), py::arg("chunk_bytes"),
        "The smallest message the shm allreduce runs chunk by chunk on a node of `local_size` ranks.");
  m.def("grouped_allreduce_async", &grouped_allreduce_async, py::arg("inputs"), py::arg("outputs"), py::arg("op"),
        py::arg("average"), py::arg("algorithm"), py::arg("names"), py::arg("blocking") = false,
        py::arg("group") = 0);
  m.def("allreduce_blocking", &allreduce_blocking, py::arg("tensor"), py::arg("op"), py::arg("average"),
        py::arg("algorithm"), py::arg("name"));
  m.def("broadcast_async", &broadcast_async, py::arg("tensor"), py::arg("root"), py::arg("name") = "",
        py::arg("blocking") = false, py::arg("group") = 0);
  m.def("allgather_async", &allgather_async, py::arg("tensor"), py::arg("name") = "", py::arg("group") = 0);
  m.def(
      "barrier_async",
      [](bool blocking, int64_t group) {
        comm::WorkPtr work;
        {
          py::gil_scoped_release release;
          work = engine_of(group).barrier(blocking);
        }
        return std::make_shared<Handle>(work, at::Tensor());
      },
      py::arg("blocking") = false, py::arg("group") = 0);
  register_comm_ops(m);
}

}  // namespace bindings
}  // namespace pycomm
