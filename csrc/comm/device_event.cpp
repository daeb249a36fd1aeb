#include "device_event.h"

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {
namespace {

std::atomic<uint64_t> g_created{0}, g_recorded{0}, g_stream_waits{0}, g_host_waits{0};

// Host memory stands in for a device: the work before the event is done when
// it is recorded, so waiting on it orders nothing and blocks nothing.
class HostEvent : public DeviceEvent {
 public:
  int device() const override { return -1; }
  void record(void*) override { count_event(&EventCounters::recorded); }
  void order_stream(void*) override { count_event(&EventCounters::stream_waits); }
  void synchronize() override { count_event(&EventCounters::host_waits); }
};

// The host stand-in's pool: events return here when their last holder drops them.
class HostPool {
 public:
  EventPtr acquire() {
    HostEvent* e = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        e = free_.back();
        free_.pop_back();
      }
    }
    if (!e) {
      e = new HostEvent();
      count_event(&EventCounters::created);
    }
    return EventPtr(e, [this](DeviceEvent* p) {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(static_cast<HostEvent*>(p));
    });
  }

 private:
  std::mutex mu_;
  std::vector<HostEvent*> free_;
};

thread_local EventPtr t_submit_event;

}  // namespace

void count_event(uint64_t EventCounters::*field) {
  if (field == &EventCounters::created) g_created.fetch_add(1, std::memory_order_relaxed);
  else if (field == &EventCounters::recorded) g_recorded.fetch_add(1, std::memory_order_relaxed);
  else if (field == &EventCounters::stream_waits) g_stream_waits.fetch_add(1, std::memory_order_relaxed);
  else if (field == &EventCounters::host_waits) g_host_waits.fetch_add(1, std::memory_order_relaxed);
}

EventCounters event_counters() {
  EventCounters c;
  c.created = g_created.load();
  c.recorded = g_recorded.load();
  c.stream_waits = g_stream_waits.load();
  c.host_waits = g_host_waits.load();
  return c;
}

EventPtr record_host_event() {
  static HostPool* pool = new HostPool();  // process lifetime: events may be dropped at exit
  EventPtr e = pool->acquire();
  e->record(nullptr);
  return e;
}

#ifndef PYCOMM_WITH_CUDA
EventPtr record_cuda_event(int, void*) {
  throw CommError("pycomm was built without CUDA; reinstall with a CUDA build of torch (PYCOMM_CUDA=1)");
}
#endif

void set_submit_event(EventPtr e) { t_submit_event = std::move(e); }

EventPtr take_submit_event() {
  EventPtr e;
  e.swap(t_submit_event);
  return e;
}

}  // namespace comm
}  // namespace pycomm
