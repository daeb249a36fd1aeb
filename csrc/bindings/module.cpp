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

kernels::DType to_dtype(const at::Tensor& t, const char* what) {
  kernels::DType d;
  if (!scalar_to_dtype(t.scalar_type(), &d))
    throw pybind11::type_error(std::string(what) + ": unsupported dtype " + std::string(c10::toString(t.scalar_type())) +
                               "; pycomm handles " + kernels::dtype_list());
  return d;
}

comm::Buffer to_buffer(const at::Tensor& t, const char* what) {
  if (!t.is_contiguous())
    throw pybind11::value_error(std::string(what) + ": tensor is not contiguous; call .contiguous() first");
  comm::Buffer b;
  b.data = t.data_ptr();
  b.count = static_cast<size_t>(t.numel());
  b.dtype = to_dtype(t, what);
  if (t.is_cuda()) {
    b.device = comm::Device::CUDA;
    b.device_index = t.get_device();
  } else if (t.is_cpu()) {
    b.device = comm::Device::CPU;
  } else {
    throw pybind11::value_error(std::string(what) + ": tensors on " + t.device().str() + " are not supported");
  }
  return b;
}

}  // namespace bindings
}  // namespace pycomm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pycomm native core: compute kernels and the MPI collective engine";
  pycomm::bindings::register_comm(m);
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
