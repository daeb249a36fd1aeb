#include <algorithm>
#include <memory>
#include <mutex>

#include "../comm/engine.h"
#include "../comm/memory_mover.h"
#include "bindings.h"
#ifdef PYCOMM_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;

namespace pycomm {
namespace bindings {
namespace {
std::unique_ptr<comm::Engine> g_engine;
std::mutex g_engine_mu;
}  // namespace

comm::Engine& engine() {
  if (!g_engine) throw comm::CommError("pycomm is not initialized: call pycomm.init() first");
  return *g_engine;
}

namespace {

comm::ReduceOp parse_op(const std::string& op) {
  if (op == "sum") return comm::ReduceOp::SUM;
  if (op == "min") return comm::ReduceOp::MIN;
  if (op == "max") return comm::ReduceOp::MAX;
  throw py::value_error("unknown reduction op '" + op + "'; choose sum, avg, min or max");
}

comm::Algorithm parse_algorithm(const std::string& a) {
  for (int i = 0; i <= static_cast<int>(comm::Algorithm::HIERARCHICAL_MASTER); ++i)
    if (a == comm::algorithm_name(static_cast<comm::Algorithm>(i))) return static_cast<comm::Algorithm>(i);
  throw py::value_error("unknown allreduce algorithm '" + a +
                        "'; choose auto, ring, mpi, shm, hierarchical or hierarchical_master");
}

comm::EngineOptions options_from(const py::dict& d, comm::EngineOptions o) {
  if (d.contains("ring_chunk_bytes")) o.ring_chunk_bytes = d["ring_chunk_bytes"].cast<size_t>();
  if (d.contains("auto_ring_min_bytes")) o.auto_ring_min_bytes = d["auto_ring_min_bytes"].cast<size_t>();
  if (d.contains("check_consistency")) o.check_consistency = d["check_consistency"].cast<bool>();
  if (d.contains("fusion_threshold_bytes")) o.fusion_threshold_bytes = d["fusion_threshold_bytes"].cast<size_t>();
  if (d.contains("cycle_time_ms")) o.cycle_time_ms = d["cycle_time_ms"].cast<double>();
  if (d.contains("stall_warning_s")) o.stall.warning_s = d["stall_warning_s"].cast<double>();
  if (d.contains("stall_abort_s")) o.stall.abort_s = d["stall_abort_s"].cast<double>();
  if (d.contains("staging_chunk_bytes")) o.staging_chunk_bytes = d["staging_chunk_bytes"].cast<size_t>();
  if (d.contains("force_staging")) o.force_staging = d["force_staging"].cast<bool>();
  if (d.contains("force_device_direct")) o.force_device_direct = d["force_device_direct"].cast<bool>();
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
  d["auto_ring_min_bytes"] = o.auto_ring_min_bytes;
  d["check_consistency"] = o.check_consistency;
  d["fusion_threshold_bytes"] = o.fusion_threshold_bytes;
  d["cycle_time_ms"] = o.cycle_time_ms;
  d["stall_warning_s"] = o.stall.warning_s;
  d["stall_abort_s"] = o.stall.abort_s;
  d["staging_chunk_bytes"] = o.staging_chunk_bytes;
  d["force_staging"] = o.force_staging;
  d["force_device_direct"] = o.force_device_direct;
  py::list table;
  for (const auto& e : o.auto_table) table.append(py::make_tuple(e.first, comm::algorithm_name(e.second)));
  d["auto_table"] = table;
  return d;
}

// What Python holds for an asynchronous collective. The tensors stay alive in
// the Work's keepalive until the engine is done with them, even if the handle
// is dropped unwaited.
class Handle {
 public:
  Handle(comm::WorkPtr work, at::Tensor result) : work_(std::move(work)), result_(std::move(result)) {}

  // allgather: the output is allocated on the engine thread once the row
  // counts are known; wait() gives it its final shape.
  struct Gathered {
    at::Tensor flat;
    int64_t rows = 0;
    std::vector<int64_t> row_shape;
  };
  std::shared_ptr<Gathered> gathered;

  at::Tensor wait() {
    {
      py::gil_scoped_release release;
      work_->wait();
    }
    if (gathered) {
      std::vector<int64_t> shape{gathered->rows};
      shape.insert(shape.end(), gathered->row_shape.begin(), gathered->row_shape.end());
      result_ = gathered->flat.view(shape);
      gathered.reset();
    }
    return result_;
  }
  bool done() const { return work_->done(); }
  std::string description() const { return work_->description(); }

 private:
  comm::WorkPtr work_;
  at::Tensor result_;
};

// The engine reads device tensors from its own streams: first let the work
// already queued on torch's current stream (which produced them) finish.
void sync_producer(const at::Tensor& t) {
#ifdef PYCOMM_WITH_CUDA
  if (t.is_cuda()) c10::cuda::getCurrentCUDAStream(t.get_device()).synchronize();
#else
  (void)t;
#endif
}

std::shared_ptr<void> keep(std::vector<at::Tensor> tensors) {
  for (const auto& t : tensors) sync_producer(t);
  return std::make_shared<std::vector<at::Tensor>>(std::move(tensors));
}

std::shared_ptr<Handle> allreduce_async(const at::Tensor& input, const at::Tensor& output, const std::string& op,
                                        bool average, const std::string& algorithm, const std::string& name,
                                        bool blocking) {
  comm::AllreduceArgs a;
  a.input = to_buffer(input, "allreduce");
  a.output = to_buffer(output, "allreduce out");
  if (a.input.count != a.output.count || a.input.dtype != a.output.dtype)
    throw py::value_error("allreduce: out must have the input's shape and dtype");
  a.op = parse_op(op);
  a.average = average;
  a.algorithm = parse_algorithm(algorithm);
  a.name = name;
  comm::WorkPtr work;
  {
    py::gil_scoped_release release;  // a blocking call may run the collective right here
    work = engine().allreduce(a, keep({input, output}), blocking);
  }
  return std::make_shared<Handle>(work, output);
}

std::shared_ptr<Handle> broadcast_async(const at::Tensor& tensor, int root, const std::string& name, bool blocking) {
  comm::Buffer b = to_buffer(tensor, "broadcast");
  comm::WorkPtr work;
  {
    py::gil_scoped_release release;
    work = engine().broadcast(b, root, name, keep({tensor}), blocking);
  }
  return std::make_shared<Handle>(work, tensor);
}

std::shared_ptr<Handle> allgather_async(const at::Tensor& tensor, const std::string& name) {
  if (tensor.dim() == 0) throw py::value_error("allgather: tensor needs at least one dimension");
  comm::Buffer b = to_buffer(tensor, "allgather");
  auto gathered = std::make_shared<Handle::Gathered>();
  gathered->row_shape.assign(tensor.sizes().begin() + 1, tensor.sizes().end());
  int64_t row_numel = 1;
  for (int64_t d : gathered->row_shape) row_numel *= d;
  auto options = tensor.options();
  auto allocate = [gathered, options, row_numel](size_t rows) -> void* {
    gathered->rows = static_cast<int64_t>(rows);
    gathered->flat = at::empty({gathered->rows * row_numel}, options);
    return gathered->flat.data_ptr();
  };
  auto work = engine().allgather(b, static_cast<size_t>(tensor.size(0)), gathered->row_shape, allocate, name,
                                 keep({tensor}));
  auto handle = std::make_shared<Handle>(work, at::Tensor());
  handle->gathered = gathered;
  return handle;
}

}  // namespace

void register_comm(py::module_& m) {
  static py::exception<comm::CommError> comm_error(m, "CommError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const comm::CommError& e) {
      py::set_error(comm_error, e.what());
    }
  });

  py::class_<Handle, std::shared_ptr<Handle>>(m, "Handle", "An asynchronous collective in flight.")
      .def("wait", &Handle::wait, "Block until the collective is done (GIL released); return its result tensor.")
      .def("done", &Handle::done, "True once the collective has finished (successfully or not).")
      .def("__repr__", [](const Handle& h) {
        return "<pycomm.Handle " + h.description() + (h.done() ? " done>" : " pending>");
      });

  m.def(
      "engine_start",
      [](int64_t world, int64_t local, int64_t cross, int64_t control, int rank, int size, int local_rank,
         int local_size, int node_rank, int num_nodes, bool homogeneous, const py::dict& options) {
        std::lock_guard<std::mutex> lock(g_engine_mu);
        if (g_engine) throw comm::CommError("pycomm engine already started");
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
        g_engine = std::make_unique<comm::Engine>(t, MPI_Comm_f2c(static_cast<MPI_Fint>(control)), homogeneous,
                                                  options_from(options, comm::EngineOptions()));
      },
      "Start the engine on communicators given as Fortran handles (mpi4py's Comm.py2f()).");
  m.def("engine_stop", [] {
    std::lock_guard<std::mutex> lock(g_engine_mu);
    py::gil_scoped_release release;
    g_engine.reset();  // drains the queue, joins the worker
  });
  m.def("engine_running", [] { return static_cast<bool>(g_engine); });
  m.def("mpi_cuda_aware", [] { return comm::mpi_is_cuda_aware(); },
        "Whether MPI reads CUDA device memory itself (else device data is staged through pinned host buffers).");
  m.def("set_options", [](const py::dict& d) {
    comm::EngineOptions o = options_from(d, engine().options());
    py::gil_scoped_release release;  // queued behind earlier operations, agreed by every rank
    engine().set_options(o);
  });
  m.def("get_options", [] { return options_to(engine().options()); });
  m.def("stats", [] {
    auto s = engine().stats();
    py::dict d;
    d["operations"] = s.operations;
    d["rounds"] = s.rounds;
    d["fused_tensors"] = s.fused_tensors;
    return d;
  });
  m.def("resolve_algorithm", [](const std::string& algorithm, size_t bytes) {
    return std::string(comm::algorithm_name(engine().resolve(parse_algorithm(algorithm), bytes, engine().options())));
  }, "The algorithm that `algorithm` (e.g. 'auto') means for a message of `bytes` on this topology.");

  m.def("allreduce_async", &allreduce_async, py::arg("input"), py::arg("output"), py::arg("op"), py::arg("average"),
        py::arg("algorithm"), py::arg("name") = "", py::arg("blocking") = false);
  m.def("broadcast_async", &broadcast_async, py::arg("tensor"), py::arg("root"), py::arg("name") = "",
        py::arg("blocking") = false);
  m.def("allgather_async", &allgather_async, py::arg("tensor"), py::arg("name") = "");
  m.def(
      "barrier_async",
      [](bool blocking) {
        comm::WorkPtr work;
        {
          py::gil_scoped_release release;
          work = engine().barrier(blocking);
        }
        return std::make_shared<Handle>(work, at::Tensor());
      },
      py::arg("blocking") = false);
}

}  // namespace bindings
}  // namespace pycomm
