// The torch <-> pycomm boundary. Only the files in csrc/bindings/ include
// torch headers: they check tensors, hand raw pointers down and release the
// GIL around every call into the engine or a kernel.
#pragma once
#include <torch/extension.h>

#include <memory>
#include <vector>

#include "../comm/common.h"
#include "../comm/device_event.h"

namespace pycomm {
namespace comm {
class Engine;
}
namespace bindings {

// torch dtype -> kernels::DType (the table in kernels/dtype.h); false for a dtype pycomm does not move.
bool scalar_to_dtype(at::ScalarType st, kernels::DType* out);
// torch dtype -> kernels::DType; throws TypeError naming `what` for others.
kernels::DType to_dtype(const at::Tensor& t, const char* what);

// Describe a tensor's memory for the engine. Requires a contiguous tensor.
comm::Buffer to_buffer(const at::Tensor& t, const char* what);

// The running engine (comm.cpp); throws CommError before pycomm.init().
comm::Engine& engine();
// The engine of process group `group` (0: the world); throws CommError if it is not running.
comm::Engine& engine_of(int64_t group);

// Stream order (comm/device_event.h), shared by every binding that submits tensors (comm.cpp,
// compression.cpp, the c10d backend):
// torch's current stream on CUDA device `device` (a cudaStream_t); nullptr for the host stand-in.
void* current_stream(int device);
// The tensors of one submission, kept alive until the engine is done (the Work's keepalive), and the
// submission's ready event, set for this thread's next engine call: recorded on torch's current
// stream of the tensors' CUDA device (ValueError if they are on several); the host stand-in's event
// for host tensors while `engine` runs force_staging / force_device_direct; none otherwise (comm.cpp).
std::shared_ptr<std::vector<at::Tensor>> keep(std::vector<at::Tensor> tensors, comm::Engine& engine);
// Clears the thread's submit event when a submission ends: one whose engine call threw before
// queueing must not leave its event to the next submission from this thread.
struct SubmitScope {
  SubmitScope() = default;
  SubmitScope(const SubmitScope&) = delete;
  SubmitScope& operator=(const SubmitScope&) = delete;
  ~SubmitScope() { comm::set_submit_event(nullptr); }
};
// Completion: make the caller's current stream wait for the engine's done event (no host block);
// nothing for host memory (no event).
inline void order_current_stream(const comm::EventPtr& done) {
  if (done) done->order_stream(current_stream(done->device()));
}

void register_comm(pybind11::module_& m);
void register_comm_ops(pybind11::module_& m);  // comm.cpp: reduce_scatter, alltoall, process groups
void register_c10d(pybind11::module_& m);      // c10d/python.cpp: the torch.distributed backend
void register_compression(pybind11::module_& m);
void register_kernels(pybind11::module_& m);
void register_optim(pybind11::module_& m);
void register_ps(pybind11::module_& m);
void register_join_timeline(pybind11::module_& m);  // join_timeline.cpp: pycomm.join, the timeline
void register_backup(pybind11::module_& m);         // backup.cpp: backup-worker sessions (backup_sgd)
void register_fault(pybind11::module_& m);          // fault.cpp: RanksFailedError, elastic mode (after register_comm)

}  // namespace bindings
}  // namespace pycomm
