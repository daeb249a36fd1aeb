// The mover of host memory: its copies run on two lane threads, in order per
// lane, and its working memory is plain host memory. The Executor keeps one
// per engine, for host tensors' working memory (the compressed allreduce's
// buffers) and for host memory standing in for a device (force_staging,
// force_device_direct), where it runs the device paths' pipeline, chunking and
// ordering on CPUs.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "memory_mover.h"

namespace pycomm {
namespace comm {

class HostMover : public MemoryMover {
 public:
  HostMover();
  ~HostMover() override;
  void* alloc_staging(size_t bytes) override;
  void free_staging(void* p) override;
  void to_host_async(void* host, const void* src, size_t bytes, int lane) override;
  void to_device_async(void* dst, const void* host, size_t bytes, int lane) override;
  void wait_lane(int lane) override;
  void join_lanes() override {
    wait_lane(0);
    wait_lane(1);
  }
  void* alloc_device(size_t bytes) override { return alloc_staging(bytes); }
  void free_device(void* p) override { free_staging(p); }
  void reduce(void* dst, const void* src, size_t count, kernels::DType dtype, kernels::ReduceOp op) override;
  void scale(void* dst, size_t count, kernels::DType dtype, double factor) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void pack(const void* const* srcs, const size_t* counts, size_t num, void* flat, kernels::DType dtype) override;
  void unpack(const void* flat, void* const* dsts, const size_t* counts, size_t num, kernels::DType dtype,
              double scale) override;
  std::unique_ptr<PeerMemory> peer_memory() override { return make_host_peer_memory(); }
  // The lanes' copies are waited for before the engine finishes an operation, so an event needs no ordering here.
  void wait_event(DeviceEvent& producer) override { producer.order_stream(nullptr); }
  EventPtr record_done() override { return record_host_event(); }

 private:
  struct Lane {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> tasks;
    size_t pending = 0;
    bool stop = false;
    std::thread thread;
  };
  void post(int lane, std::function<void()> task);
  Lane lanes_[2];
};

}  // namespace comm
}  // namespace pycomm
