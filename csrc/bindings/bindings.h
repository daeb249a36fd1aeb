// The torch <-> pycomm boundary. Only the files in csrc/bindings/ include
// torch headers: they check tensors, hand raw pointers down and release the
// GIL around every call into the engine or a kernel.
#pragma once
#include <torch/extension.h>

#include "../comm/common.h"

namespace pycomm {
namespace comm {
class Engine;
}
namespace bindings {

// torch dtype -> kernels::DType; throws TypeError naming `what` for others.
kernels::DType to_dtype(const at::Tensor& t, const char* what);

// Describe a tensor's memory for the engine. Requires a contiguous tensor.
comm::Buffer to_buffer(const at::Tensor& t, const char* what);

// The running engine (comm.cpp); throws CommError before pycomm.init().
comm::Engine& engine();

void register_comm(pybind11::module_& m);
void register_compression(pybind11::module_& m);
void register_kernels(pybind11::module_& m);
void register_ps(pybind11::module_& m);

}  // namespace bindings
}  // namespace pycomm
