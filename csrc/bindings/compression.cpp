// Bindings of the compressed allreduce (fp16, bf16, onebit): tensor checks,
// the asynchronous handle with its wire-byte report, the layout helpers.
#include <memory>

#include "../comm/compressed_allreduce.h"
#include "../comm/engine.h"
#include "bindings.h"
#include "error_feedback.h"

namespace py = pybind11;

namespace pycomm {
namespace bindings {
namespace {

comm::Compression parse_compression(const std::string& c) {
  comm::Compression id;
  if (comm::compression_from_name(c, &id)) return id;
  throw py::value_error("unknown compression '" + c + "'; the engine runs " + comm::compression_choices());
}

comm::Buffer float_buffer(const at::Tensor& t, const char* what) {
  if (t.scalar_type() != at::kFloat)
    throw py::type_error(std::string(what) + ": expected a float32 tensor, got " +
                         std::string(c10::toString(t.scalar_type())));
  return to_buffer(t, what);  // host or CUDA memory; the engine checks that all of them share one device
}

std::shared_ptr<Handle> compressed_allreduce_async(const at::Tensor& input, const at::Tensor& output,
                                                             const std::string& compression, bool average,
                                                             const std::optional<at::Tensor>& worker_residual,
                                                             const std::optional<at::Tensor>& server_residual,
                                                             const std::optional<at::Tensor>& mask,
                                                             const std::string& name, bool blocking) {
  SubmitScope submit;
  comm::CompressedArgs a;
  a.input = float_buffer(input, "compressed allreduce");
  a.output = float_buffer(output, "compressed allreduce out");
  if (a.input.count != a.output.count) throw py::value_error("compressed allreduce: out must have the input's size");
  a.compression = parse_compression(compression);
  a.average = average;
  a.name = name;
  std::vector<at::Tensor> tensors{input, output};
  if (a.compression == comm::Compression::ONEBIT) {
    if (!worker_residual || !server_residual)
      throw py::value_error("compressed allreduce: onebit needs its worker and server residuals");
    a.worker_residual = float_buffer(*worker_residual, "onebit worker residual");
    a.server_residual = float_buffer(*server_residual, "onebit server residual");
    tensors.push_back(*worker_residual);
    tensors.push_back(*server_residual);
    if (mask) {
      const at::Tensor& mk = *mask;
      if ((mk.scalar_type() != at::kByte && mk.scalar_type() != at::kBool) || !mk.is_contiguous())
        throw py::type_error("onebit mask: expected a contiguous uint8 or bool tensor");
      a.mask.data = mk.data_ptr();
      a.mask.count = static_cast<size_t>(mk.numel());  // one byte per element; the dtype field is not read
      if (mk.is_cuda()) {
        a.mask.device = comm::Device::CUDA;
        a.mask.device_index = mk.get_device();
      }
      tensors.push_back(mk);
    }
  }
  a.stats = std::make_shared<comm::CompressedStats>();
  auto stats = a.stats;
  // The ready event on torch's current stream (no host block here); the engine waits on it.
  auto keepalive = keep(std::move(tensors), engine());
  comm::WorkPtr work;
  {
    py::gil_scoped_release release;  // a blocking call may run the collective right here
    work = engine().compressed_allreduce(a, keepalive, blocking);
  }
  return std::make_shared<Handle>(work, output, stats);
}

}  // namespace

void register_compression(py::module_& m) {
  m.def("compressed_allreduce_async", &compressed_allreduce_async, py::arg("input"), py::arg("output"),
        py::arg("compression"), py::arg("average"), py::arg("worker_residual") = py::none(),
        py::arg("server_residual") = py::none(), py::arg("mask") = py::none(), py::arg("name") = "",
        py::arg("blocking") = false);
  using Residuals = OnebitResiduals<std::string>;
  py::class_<Residuals>(m, "OnebitResiduals",
                        "Error feedback of the onebit compressed allreduce: this rank's (worker, server) residuals "
                        "per tensor name, carried from one call to the next (csrc/bindings/error_feedback.h; the "
                        "c10d backend keeps its call sites' residuals in the same store).")
      .def(py::init<>())
      .def(
          "for_call",
          [](Residuals& r, const std::string& name, const at::Tensor& t, int world) {
            if (world < 1) throw py::value_error("OnebitResiduals.for_call: world must be >= 1");
            const Residuals::Pair& p = r.for_call(name, t, world, 0, [](const std::string& k) { return k; });
            return py::make_tuple(p.worker, p.server);
          },
          py::arg("name"), py::arg("tensor"), py::arg("world"),
          "(worker, server) residuals for `tensor`'s call under `name` at `world` ranks: made zero on the "
          "tensor's device at the first call, the server residual reset when the world size changed, both "
          "moved to the tensor's device; ValueError if `name` holds residuals of another element count.")
      .def(
          "get",
          [](const Residuals& r, const std::string& name) -> py::object {
            const Residuals::Pair* p = r.find(name);
            if (!p) return py::none();
            return py::make_tuple(p->worker, p->server);
          },
          py::arg("name"), "(worker, server) of `name` (the live tensors), or None.")
      .def(
          "put",
          [](Residuals& r, const std::string& name, const at::Tensor& worker, const at::Tensor& server, int world) {
            if (worker.scalar_type() != at::kFloat || server.scalar_type() != at::kFloat)
              throw py::type_error("OnebitResiduals.put: residuals are float32");
            r.put(name, worker, server, world);
          },
          py::arg("name"), py::arg("worker"), py::arg("server"), py::arg("world"),
          "Residuals of `name` from a checkpoint, saved at `world` ranks (kept as given until the next call).")
      .def("pop", [](Residuals& r, const std::string& name) { r.erase(name); }, py::arg("name"))
      .def("clear", &Residuals::clear)
      .def("names",
           [](const Residuals& r) {
             std::vector<std::string> names;
             for (const auto& kv : r.entries()) names.push_back(kv.first);
             return names;
           })
      .def("__len__", &Residuals::size)
      .def("__contains__", [](const Residuals& r, const std::string& name) { return r.find(name) != nullptr; });
  m.def(
      "onebit_layout",
      [](size_t n, int world) {
        if (world < 1) throw py::value_error("onebit_layout: world must be >= 1");
        comm::OneBitLayout l = comm::onebit_layout(n, world);
        return py::make_tuple(l.padded, l.chunk);
      },
      py::arg("n"), py::arg("world"), "(padded n, chunk m): n padded to a multiple of 8*world, m = padded/world.");
  m.def(
      "engine_compressions",
      [] {
        py::list names;
        for (const auto& e : comm::compression_table()) names.append(e.name);
        return names;
      },
      "The compressions the engine runs, by name, in the order of its table (csrc/comm/compressed_allreduce.cpp).");
  m.def(
      "compressed_wire_bytes",
      [](const std::string& compression, size_t n, int world, int rank) {
        return comm::compressed_wire_bytes(parse_compression(compression), n, world, rank);
      },
      py::arg("compression"), py::arg("n"), py::arg("world"), py::arg("rank"),
      "Exact bytes `rank` sends in one compressed allreduce of n float32 elements.");
  m.def("ring_wire_bytes", &comm::ring_wire_bytes, py::arg("n"), py::arg("element_size"), py::arg("world"),
        py::arg("rank"), "Exact bytes `rank` sends in pycomm's ring allreduce.");
}

}  // namespace bindings
}  // namespace pycomm
