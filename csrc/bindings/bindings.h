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
// The engine of process group `group` (0: the world); throws CommError if it is not running.
comm::Engine& engine_of(int64_t group);

void register_comm(pybind11::module_& m);
void register_comm_ops(pybind11::module_& m);  // comm.cpp: reduce_scatter, alltoall, process groups
void register_c10d(pybind11::module_& m);      // c10d/python.cpp: the torch.distributed backend
void register_compression(pybind11::module_& m);
void register_kernels(pybind11::module_& m);
void register_optim(pybind11::module_& m);
void register_ps(pybind11::module_& m);
void register_join_timeline(pybind11::module_& m);  // join_timeline.cpp: pycomm.join, the timeline

}  // namespace bindings
}  // namespace pycomm
