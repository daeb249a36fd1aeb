#include "../kernels/reduce.h"
#include "bindings.h"

namespace py = pybind11;

namespace pycomm {
namespace bindings {
namespace {

void check_host(const at::Tensor& t, const char* what) {
  if (!t.is_cpu()) throw py::value_error(std::string(what) + ": expected a CPU tensor, got one on " + t.device().str());
}

void reduce_(at::Tensor dst, const at::Tensor& src, const std::string& op) {
  if (dst.scalar_type() != src.scalar_type() || dst.numel() != src.numel())
    throw py::value_error("reduce_: dst and src must have the same dtype and number of elements");
  comm::Buffer d = to_buffer(dst, "reduce_ dst"), s = to_buffer(src, "reduce_ src");
  kernels::ReduceOp rop;
  if (op == "sum") rop = kernels::ReduceOp::SUM;
  else if (op == "min") rop = kernels::ReduceOp::MIN;
  else if (op == "max") rop = kernels::ReduceOp::MAX;
  else throw py::value_error("reduce_: unknown op '" + op + "'; choose sum, min or max");
  check_host(dst, "reduce_");
  check_host(src, "reduce_");
  py::gil_scoped_release release;
  kernels::reduce_cpu(d.data, s.data, d.count, d.dtype, rop);
}

}  // namespace

void register_kernels(py::module_& m) {
  m.def("reduce_", &reduce_, py::arg("dst"), py::arg("src"), py::arg("op") = "sum",
        "dst = dst op src element-wise, in place (fp16/bf16 combined in fp32, rounded once).");
}

}  // namespace bindings
}  // namespace pycomm
