// CUDA events for stream order (device_event.h): one pool per device of
// events created with cudaEventDisableTiming, reused across calls.
#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "device_event.h"

namespace pycomm {
namespace comm {
namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(rc));
}

// Runs `fn` with `device` current, restoring the caller's device after.
template <typename F>
void on_device(int device, F fn) {
  int prev = -1;
  check(cudaGetDevice(&prev), "cudaGetDevice");
  if (prev != device) check(cudaSetDevice(device), "cudaSetDevice");
  try {
    fn();
  } catch (...) {
    if (prev != device) cudaSetDevice(prev);
    throw;
  }
  if (prev != device) check(cudaSetDevice(prev), "cudaSetDevice (restore)");
}

class CudaEvent : public DeviceEvent {
 public:
  CudaEvent(int device, cudaEvent_t e) : device_(device), event_(e) {}
  int device() const override { return device_; }
  void record(void* stream) override {
    on_device(device_, [&] { check(cudaEventRecord(event_, static_cast<cudaStream_t>(stream)), "cudaEventRecord"); });
    count_event(&EventCounters::recorded);
  }
  void order_stream(void* stream) override {
    on_device(device_, [&] {
      check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), event_, 0), "cudaStreamWaitEvent");
    });
    count_event(&EventCounters::stream_waits);
  }
  void synchronize() override {
    check(cudaEventSynchronize(event_), "cudaEventSynchronize");
    count_event(&EventCounters::host_waits);
  }
  cudaEvent_t get() const { return event_; }

 private:
  int device_;
  cudaEvent_t event_;
};

class CudaPool {
 public:
  explicit CudaPool(int device) : device_(device) {}
  EventPtr acquire() {
    CudaEvent* e = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        e = free_.back();
        free_.pop_back();
      }
    }
    if (!e) {
      cudaEvent_t ev = nullptr;
      on_device(device_, [&] { check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate"); });
      e = new CudaEvent(device_, ev);
      count_event(&EventCounters::created);
    }
    // Back to the pool, never destroyed: a pooled event may be re-recorded at
    // once (cudaEventRecord replaces the earlier capture).
    return EventPtr(e, [this](DeviceEvent* p) {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(static_cast<CudaEvent*>(p));
    });
  }

 private:
  int device_;
  std::mutex mu_;
  std::vector<CudaEvent*> free_;
};

CudaPool& pool(int device) {
  static std::mutex mu;
  static std::vector<CudaPool*>* pools = new std::vector<CudaPool*>();  // process lifetime
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0) throw std::runtime_error("pycomm: CUDA event for a negative device index");
  if (pools->size() <= static_cast<size_t>(device)) pools->resize(static_cast<size_t>(device) + 1, nullptr);
  CudaPool*& p = (*pools)[static_cast<size_t>(device)];
  if (!p) p = new CudaPool(device);
  return *p;
}

}  // namespace

EventPtr record_cuda_event(int device, void* stream) {
  EventPtr e = pool(device).acquire();
  e->record(stream);
  return e;
}

}  // namespace comm
}  // namespace pycomm
