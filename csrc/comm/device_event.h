// Stream order between the caller's device work and pycomm's engine (the
// pattern of torch's NCCL process group and Horovod's ready events):
//
//   submit:     the bindings record a "ready" event on the caller's current
//               stream; the caller's thread goes on at once (no host block).
//   engine:     before it touches the memory, the engine makes its own
//               streams wait on the ready event (cudaStreamWaitEvent), and
//               blocks its own thread on it (cudaEventSynchronize) before it
//               hands device pointers to MPI or to host copies.
//   completion: the engine records a "done" event after its device work;
//               Handle.wait() makes the caller's current stream wait on it,
//               Handle.synchronize() blocks the host on it.
//
// Events come from per-device pools and return there when the last holder
// drops them: no cudaEventCreate/Destroy per call. No CUDA headers here, so
// the engine compiles without CUDA; the CUDA events live in
// device_event_cuda.cu (CUDA builds only), the host stand-in's in
// device_event.cpp.
#pragma once
#include <cstdint>
#include <memory>

namespace pycomm {
namespace comm {

class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // The CUDA device the event belongs to; -1 for the host stand-in.
  virtual int device() const = 0;
  // Record the event on `stream` (a cudaStream_t of device(); ignored by the stand-in).
  virtual void record(void* stream) = 0;
  // Make `stream` wait for the event without blocking the host (cudaStreamWaitEvent).
  virtual void order_stream(void* stream) = 0;
  // Block the calling thread until the work recorded before the event has finished.
  virtual void synchronize() = 0;
};
using EventPtr = std::shared_ptr<DeviceEvent>;

// A recorded event from device `device`'s pool, recorded on `stream`.
// CUDA builds only (device_event_cuda.cu); elsewhere it throws.
EventPtr record_cuda_event(int device, void* stream);
// The host stand-in (PYCOMM_FORCE_STAGING / PYCOMM_FORCE_DEVICE_DIRECT on host
// memory): an event that is complete once recorded, since work on host memory
// is done when issued. It goes through the same pool and counters, so the
// stream-order control flow runs on CPU machines.
EventPtr record_host_event();

// Counters over every pool of the process.
struct EventCounters {
  uint64_t created = 0;    // events constructed (bounded by how many are in flight at once)
  uint64_t recorded = 0;   // events recorded
  uint64_t stream_waits = 0;  // order_stream() calls
  uint64_t host_waits = 0;    // synchronize() calls
};
EventCounters event_counters();
// device_event.cpp: bumped by both kinds of events.
void count_event(uint64_t EventCounters::*field);

// The submitting thread's ready event for the operation it is about to
// submit: the bindings set it, Engine::enqueue takes it (and clears it).
void set_submit_event(EventPtr e);
EventPtr take_submit_event();

}  // namespace comm
}  // namespace pycomm
