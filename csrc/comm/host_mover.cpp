#include "host_mover.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "../kernels/fusion.h"
#include "../kernels/reduce.h"
#include "common.h"

namespace pycomm {
namespace comm {

HostMover::HostMover() {
  for (auto& lane : lanes_) {
    Lane* l = &lane;
    l->thread = std::thread([l] {
      for (;;) {
        std::function<void()> task;
        {
          std::unique_lock<std::mutex> lock(l->mu);
          l->cv.wait(lock, [l] { return l->stop || !l->tasks.empty(); });
          if (l->tasks.empty()) return;
          task = std::move(l->tasks.front());
          l->tasks.pop_front();
        }
        task();
        {
          std::lock_guard<std::mutex> lock(l->mu);
          --l->pending;
        }
        l->cv.notify_all();
      }
    });
  }
}

HostMover::~HostMover() {
  drop_cache();
  for (auto& lane : lanes_) {
    {
      std::lock_guard<std::mutex> lock(lane.mu);
      lane.stop = true;
    }
    lane.cv.notify_all();
    lane.thread.join();
  }
}

void* HostMover::alloc_staging(size_t bytes) {
  void* p = std::malloc(std::max<size_t>(bytes, 1));
  if (!p) throw CommError("staging: out of host memory");
  return p;
}

void HostMover::free_staging(void* p) { std::free(p); }

void HostMover::post(int lane, std::function<void()> task) {
  Lane& l = lanes_[lane & 1];
  {
    std::lock_guard<std::mutex> lock(l.mu);
    l.tasks.push_back(std::move(task));
    ++l.pending;
  }
  l.cv.notify_all();
}

void HostMover::to_host_async(void* host, const void* src, size_t bytes, int lane) {
  post(lane, [=] { std::memcpy(host, src, bytes); });
}

void HostMover::to_device_async(void* dst, const void* host, size_t bytes, int lane) {
  post(lane, [=] { std::memcpy(dst, host, bytes); });
}

void HostMover::reduce(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  kernels::reduce_cpu(dst, src, count, dtype, op);
}

void HostMover::scale(void* dst, size_t count, DType dtype, double factor) {
  kernels::scale_cpu(dst, count, dtype, factor);
}

void HostMover::copy(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

void HostMover::pack(const void* const* srcs, const size_t* counts, size_t num, void* flat, DType dtype) {
  kernels::fusion_pack_cpu(srcs, counts, num, flat, dtype);
}

void HostMover::unpack(const void* flat, void* const* dsts, const size_t* counts, size_t num, DType dtype,
                       double scale) {
  kernels::fusion_unpack_cpu(flat, dsts, counts, num, dtype, scale);
}

void HostMover::wait_lane(int lane) {
  Lane& l = lanes_[lane & 1];
  std::unique_lock<std::mutex> lock(l.mu);
  l.cv.wait(lock, [&l] { return l.pending == 0; });
}

}  // namespace comm
}  // namespace pycomm
