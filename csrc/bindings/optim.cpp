// torch-facing wrappers of the fused optimizer updates (csrc/kernels/optim_update.h):
// _C.lars_update_ and _C.lamb_update_ update float32 CPU tensors in place, with the GIL released.
#include <string>

#include "../kernels/optim_update.h"
#include "bindings.h"

namespace py = pybind11;

namespace pycomm {
namespace bindings {
namespace {

void check_f32(const char* fn, const char* what, const at::Tensor& t, int64_t numel) {
  if (!t.is_cpu())
    throw py::value_error(std::string(fn) + ": " + what + " is on " + t.device().str() +
                          "; the fused update handles CPU tensors (use fused=False on other devices)");
  if (t.scalar_type() != at::kFloat)
    throw py::type_error(std::string(fn) + ": " + what + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                         "; the fused update takes float32");
  if (!t.is_contiguous()) throw py::value_error(std::string(fn) + ": " + what + " is not contiguous");
  if (t.numel() != numel)
    throw py::value_error(std::string(fn) + ": " + what + " has " + std::to_string(t.numel()) +
                          " elements, the parameter " + std::to_string(numel));
}

float lars_update(at::Tensor w, const at::Tensor& g, at::Tensor buf, double lr, double momentum, double weight_decay,
                  double trust_coefficient, double eps, bool adapt) {
  const char* fn = "pycomm._C.lars_update_";
  const int64_t n = w.numel();
  check_f32(fn, "param", w, n);
  check_f32(fn, "grad", g, n);
  check_f32(fn, "momentum_buffer", buf, n);
  kernels::LarsParams p{float(lr), float(momentum), float(weight_decay), float(trust_coefficient), float(eps), adapt};
  py::gil_scoped_release release;
  return kernels::lars_update_cpu(w.data_ptr<float>(), g.data_ptr<float>(), buf.data_ptr<float>(), size_t(n), p);
}

float lamb_update(at::Tensor w, const at::Tensor& g, at::Tensor m, at::Tensor v, double lr, double beta1, double beta2,
                  double eps, double weight_decay, double bias_correction1, double bias_correction2, double clamp_lo,
                  double clamp_hi, bool adapt) {
  const char* fn = "pycomm._C.lamb_update_";
  const int64_t n = w.numel();
  check_f32(fn, "param", w, n);
  check_f32(fn, "grad", g, n);
  check_f32(fn, "exp_avg", m, n);
  check_f32(fn, "exp_avg_sq", v, n);
  if (!(bias_correction1 > 0.0) || !(bias_correction2 > 0.0))
    throw py::value_error(std::string(fn) + ": bias corrections must be positive");
  kernels::LambParams p{float(lr),
                        float(beta1),
                        float(beta2),
                        float(eps),
                        float(weight_decay),
                        float(1.0 - beta1),
                        float(1.0 - beta2),
                        float(bias_correction1),
                        float(bias_correction2),
                        float(clamp_lo),
                        float(clamp_hi),
                        adapt};
  py::gil_scoped_release release;
  return kernels::lamb_update_cpu(w.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                                  size_t(n), p);
}

}  // namespace

void register_optim(py::module_& m) {
  m.def("lars_update_", &lars_update, py::arg("param"), py::arg("grad"), py::arg("momentum_buffer"), py::arg("lr"),
        py::arg("momentum"), py::arg("weight_decay"), py::arg("trust_coefficient"), py::arg("eps"), py::arg("adapt"),
        "Fused LARS step of one float32 CPU tensor, in place; returns the local learning rate factor");
  m.def("lamb_update_", &lamb_update, py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("bias_correction1"), py::arg("bias_correction2"), py::arg("clamp_lo"), py::arg("clamp_hi"),
        py::arg("adapt"), "Fused LAMB step of one float32 CPU tensor, in place; returns the trust ratio");
}

}  // namespace bindings
}  // namespace pycomm
