// Moving device memory through host staging buffers, written once for any
// kind of memory.
//
// With an MPI that cannot read device memory, an allreduce of device data is
// cut into chunks that travel device -> pinned host buffer -> host allreduce
// -> device, double-buffered: while chunk k is reduced across ranks on the
// host, chunk k+1 is being copied down and chunk k-1 copied back up.
//
// A MemoryMover says how bytes move between the buffer's memory and host
// staging memory. Copies are asynchronous and ordered per lane (a CUDA stream
// on GPUs); the pipeline uses lane k % 2 for chunk k.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "common.h"
#include "memory_mover.h"

namespace pycomm {
namespace comm {

// Host memory standing in for a device: each lane is a thread that runs its
// copies in order. Exercises the pipeline's chunking and ordering on CPUs.
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

// Two reusable host chunk buffers from one mover.
struct StagingBuffers {
  void* chunk[2] = {nullptr, nullptr};
  size_t bytes = 0;
  MemoryMover* owner = nullptr;
  void reserve(MemoryMover& mover, size_t bytes);
  void release();
  ~StagingBuffers() { release(); }
};

// Double-buffered staging of `src` (in the mover's memory) through host
// chunks of at most `chunk_bytes` into `dst` (same shape, may equal src);
// `host_allreduce` reduces one host chunk across ranks in place. Every rank
// cuts the buffer into the same chunks. The host waits per chunk, for the
// download MPI reads next (and the upload whose buffer it reuses); at the end
// it waits for the last uploads only if `host_wait` (a caller that reads dst
// on another stream or on the host), else they are ordered before lane 0's
// next work and record_done() (MemoryMover::join_lanes).
void staged_allreduce(const Buffer& src, const Buffer& dst, MemoryMover& mover, StagingBuffers& staging,
                      size_t chunk_bytes, const std::function<void(const Buffer& host_chunk)>& host_allreduce,
                      bool host_wait = true);

}  // namespace comm
}  // namespace pycomm
