// The torch <-> pycomm boundary. Only csrc/bindings/ and the c10d backend (csrc/c10d/) include
// torch headers: they check tensors, hand raw pointers down and release the
// GIL around every call into the engine or a kernel.
#pragma once
#include <torch/extension.h>

#include <memory>
#include <mutex>
#include <vector>

#include "../comm/common.h"
#include "../comm/compressed_allreduce.h"
#include "../comm/device_event.h"
#include "../comm/engine.h"

namespace pycomm {
namespace comm {
class Engine;
}
namespace bindings {

// torch dtype -> kernels::DType (the table in kernels/dtype.h); false for a dtype pycomm does not move.
bool scalar_to_dtype(at::ScalarType st, kernels::DType* out);
// The tensor checks, one rule for every face; each face raises its own exception type (pybind11's
// here, torch's in the c10d backend). Why `t`'s dtype cannot move ("" when it can, *out set):
std::string dtype_problem(const at::Tensor& t, const char* what, kernels::DType* out);
// Why `t` cannot go to the engine as one buffer ("" when it can, *out describes it): a dense,
// contiguous tensor of a supported dtype on the host or (CUDA builds) a CUDA device.
// *dtype_fault: the problem is the dtype (a TypeError), not the layout or the memory (ValueError).
std::string tensor_problem(const at::Tensor& t, const char* what, comm::Buffer* out, bool* dtype_fault);
// torch dtype -> kernels::DType; throws TypeError naming `what` for others.
kernels::DType to_dtype(const at::Tensor& t, const char* what);
// Describe a tensor's memory for the engine (tensor_problem's rule; TypeError or ValueError).
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

// wait() on a handle first has engine `group` (-1: none) run what is queued up to it at once, on the
// waiting thread when the engine's worker has not taken that batch yet (Engine::run_queued_for), so the
// last partial batch of a step is not held back a fusion cycle. Call without the GIL.
void run_before_waiting(const comm::Work& work, int64_t group);

// t /= n in place, a correctly rounded quotient (IEEE division, bitwise torch's div_); t is a float32
// or float64 tensor. A CUDA tensor is divided on the current stream; block_host: the host then waits
// for that stream (comm.cpp).
void divide_in_place(at::Tensor& t, int64_t n, bool block_host);

// What Python holds for an asynchronous collective, compressed or not. The
// tensors stay alive in the Work's keepalive until the engine is done with
// them, even if the handle is dropped unwaited.
class Handle {
 public:
  // `group`: the engine that runs the work (0: the world), flushed by wait(); -1: none.
  Handle(comm::WorkPtr work, at::Tensor result, int64_t group = -1)
      : work_(std::move(work)), result_(std::move(result)), group_(group) {}
  // A compressed allreduce: its byte counts, filled by the engine.
  Handle(comm::WorkPtr work, at::Tensor result, std::shared_ptr<comm::CompressedStats> stats)
      : work_(std::move(work)), result_(std::move(result)), stats_(std::move(stats)) {}

  // allgather: the output is allocated on the engine thread once the row
  // counts are known; wait() gives it its final shape.
  struct Gathered {
    at::Tensor flat;
    int64_t rows = 0;
    std::vector<int64_t> row_shape;
  };
  std::shared_ptr<Gathered> gathered;

  // Stream order (device_event.h): once the engine has finished the operation, the caller's current
  // stream waits for pycomm's device work; the host does not wait for the device.
  at::Tensor wait() {
    // A work finished already (most handles of a fused batch after the first wait) needs no flush
    // and no GIL hand-off: a third of the cost (bench/fusion.py).
    if (!work_->done()) {
      pybind11::gil_scoped_release release;
      run_before_waiting(*work_, group_);
      work_->wait();
    }
    work_->wait();  // done: raises the operation's error, if any
    order_current_stream(work_->done_event());
    divide_once(false);
    return result();
  }
  // wait(), then block the host until pycomm's device work has finished.
  at::Tensor synchronize() {
    {
      pybind11::gil_scoped_release release;
      run_before_waiting(*work_, group_);
      work_->wait();
      if (comm::EventPtr done = work_->done_event()) done->synchronize();
    }
    divide_once(true);
    return result();
  }
  // pycomm.horovod's Average of float32/float64: the sum divided by `n`, the process set's size even
  // while ranks have joined (docs/compatibility.md), done once when the result is first waited for,
  // on the waiting thread: no Python call per tensor (bench/submit_cost.py, hvd.allreduce_async_).
  void divide_result_by(int64_t n) { divide_by_ = n; }
  at::Tensor result() {
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
  const comm::CompressedStats& compressed_stats() const {
    if (!stats_) throw pybind11::value_error("byte counts belong to compressed allreduces; this is " + description());
    if (!work_->done()) throw pybind11::value_error("the compressed allreduce has not finished; call wait() first");
    return *stats_;
  }

 private:
  void divide_once(bool block_host) {
    if (divide_by_ > 1) std::call_once(divided_, [&] { divide_in_place(result_, divide_by_, block_host); });
  }

  comm::WorkPtr work_;
  at::Tensor result_;
  int64_t group_ = -1;
  std::shared_ptr<comm::CompressedStats> stats_;
  int64_t divide_by_ = 0;
  std::once_flag divided_;  // a second waiter returns once the first has divided
};

// pycomm.Handle's Python object (handle.cpp): a plain CPython type holding the shared_ptr, not a
// pybind11 class. Every handle of a step is made and dropped once; a pybind11 instance costs a
// lookup, an insert and an erase in pybind11's table of live instances, on cold memory (figures in
// docs/benchmarks.md, bench/submit_cost.py). The caster below makes every binding that returns a
// std::shared_ptr<Handle> return it.
PyObject* wrap_handle(std::shared_ptr<Handle> handle);  // a new reference; nullptr with an error set
const std::shared_ptr<Handle>* unwrap_handle(PyObject* o);  // borrowed; nullptr when o is no Handle
void register_handle(pybind11::module_& m);  // handle.cpp: _C.Handle (and its old name CompressedHandle)

// _C.allreduce_async: the checked submission every allreduce face reaches (comm.cpp). op: sum | min |
// max (| avg for the checks' messages); average: divide by the ranks (engine side); divide_by > 1:
// Handle::divide_result_by. pybind11's TypeError/ValueError for what it refuses, before queueing.
std::shared_ptr<Handle> allreduce_async(const at::Tensor& input, const at::Tensor& output, const std::string& op,
                                        bool average, const std::string& algorithm, const std::string& name,
                                        bool blocking, int64_t group, int64_t divide_by);

void register_comm(pybind11::module_& m);
void register_allreduce_entry(pybind11::module_& m);  // allreduce_entry.cpp: pycomm.allreduce_async
void register_comm_ops(pybind11::module_& m);  // comm.cpp: reduce_scatter, alltoall, process groups
void register_c10d(pybind11::module_& m);      // c10d/python.cpp: the torch.distributed backend (module.cpp)
void register_compression(pybind11::module_& m);
void register_kernels(pybind11::module_& m);
void register_optim(pybind11::module_& m);
void register_ps(pybind11::module_& m);
void register_join_timeline(pybind11::module_& m);  // join_timeline.cpp: pycomm.join, the timeline
void register_backup(pybind11::module_& m);         // backup.cpp: backup-worker sessions (backup_sgd)
void register_fault(pybind11::module_& m);          // fault.cpp: RanksFailedError, elastic mode (after register_comm)

}  // namespace bindings
}  // namespace pycomm

namespace pybind11 {
namespace detail {
// std::shared_ptr<Handle> <-> pycomm.Handle (handle.cpp), for every binding in every file.
template <>
struct type_caster<std::shared_ptr<pycomm::bindings::Handle>> {
  PYBIND11_TYPE_CASTER(std::shared_ptr<pycomm::bindings::Handle>, const_name("pycomm.Handle"));
  bool load(handle src, bool) {
    const auto* held = pycomm::bindings::unwrap_handle(src.ptr());
    if (!held) return false;
    value = *held;
    return true;
  }
  static handle cast(std::shared_ptr<pycomm::bindings::Handle> src, return_value_policy, handle) {
    if (!src) return none().release();
    PyObject* o = pycomm::bindings::wrap_handle(std::move(src));
    if (!o) throw error_already_set();
    return o;
  }
};
}  // namespace detail
}  // namespace pybind11
