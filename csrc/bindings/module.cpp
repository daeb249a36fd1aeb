#include "bindings.h"

namespace pycomm {
namespace bindings {

kernels::DType to_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return kernels::DType::F32;
    case at::kDouble: return kernels::DType::F64;
    case at::kHalf: return kernels::DType::F16;
    case at::kBFloat16: return kernels::DType::BF16;
    case at::kInt: return kernels::DType::I32;
    case at::kLong: return kernels::DType::I64;
    default:
      throw pybind11::type_error(std::string(what) + ": unsupported dtype " + std::string(c10::toString(t.scalar_type())) +
                                 "; pycomm handles float32, float64, float16, bfloat16, int32 and int64");
  }
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
#ifdef PYCOMM_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
}
