#include "bindings.h"

namespace pycomm {
namespace bindings {

bool scalar_to_dtype(at::ScalarType st, kernels::DType* out) {
  switch (st) {
#define PYCOMM_DTYPE_CASE(e, v, n, s, torch_type) \
  case at::ScalarType::torch_type: *out = kernels::DType::e; return true;
    PYCOMM_DTYPES(PYCOMM_DTYPE_CASE)
#undef PYCOMM_DTYPE_CASE
    default: return false;
  }
}

std::string dtype_problem(const at::Tensor& t, const char* what, kernels::DType* out) {
  if (scalar_to_dtype(t.scalar_type(), out)) return "";
  return std::string(what) + " does not support dtype " + std::string(c10::toString(t.scalar_type())) +
         "; supported: " + kernels::dtype_list();
}

std::string tensor_problem(const at::Tensor& t, const char* what, comm::Buffer* out, bool* dtype_fault) {
  *dtype_fault = false;
  if (t.layout() != at::kStrided)
    return std::string(what) + " supports dense tensors only, got layout " + c10::str(t.layout());
  if (!t.is_contiguous()) return std::string(what) + ": tensor is not contiguous; call .contiguous() first";
  std::string why = dtype_problem(t, what, &out->dtype);
  if (!why.empty()) {
    *dtype_fault = true;
    return why;
  }
  out->data = t.data_ptr();
  out->count = static_cast<size_t>(t.numel());
  if (t.is_cuda()) {
#ifndef PYCOMM_WITH_CUDA
    return std::string(what) + ": tensor is on " + t.device().str() + " but this pycomm was built without CUDA";
#endif
    out->device = comm::Device::CUDA;
    out->device_index = t.get_device();
  } else if (t.is_cpu()) {
    out->device = comm::Device::CPU;
  } else {
    return std::string(what) + ": tensors on " + t.device().str() + " are not supported";
  }
  return "";
}

kernels::DType to_dtype(const at::Tensor& t, const char* what) {
  kernels::DType d;
  const std::string why = dtype_problem(t, what, &d);
  if (!why.empty()) throw pybind11::type_error(why);
  return d;
}

comm::Buffer to_buffer(const at::Tensor& t, const char* what) {
  comm::Buffer b;
  bool dtype_fault = false;
  const std::string why = tensor_problem(t, what, &b, &dtype_fault);
  if (why.empty()) return b;
  if (dtype_fault) throw pybind11::type_error(why);
  throw pybind11::value_error(why);
}

}  // namespace bindings
}  // namespace pycomm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pycomm native core: compute kernels and the MPI collective engine";
  pycomm::bindings::register_comm(m);
  pycomm::bindings::register_allreduce_entry(m);
  pycomm::bindings::register_c10d(m);
  pycomm::bindings::register_kernels(m);
  pycomm::bindings::register_compression(m);
  pycomm::bindings::register_optim(m);
  pycomm::bindings::register_ps(m);
  pycomm::bindings::register_join_timeline(m);
  pycomm::bindings::register_backup(m);
  pycomm::bindings::register_fault(m);
  // The dtypes the engine moves, in kernels/dtype.h's order (pycomm._ops.SUPPORTED_DTYPES reads this).
  pybind11::list names;
#define PYCOMM_DTYPE_NAME(e, v, n, s, st) names.append(n);
  PYCOMM_DTYPES(PYCOMM_DTYPE_NAME)
#undef PYCOMM_DTYPE_NAME
  m.attr("dtype_names") = names;
#ifdef PYCOMM_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
}
