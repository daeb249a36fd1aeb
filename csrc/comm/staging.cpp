#include "staging.h"

#include "../kernels/fusion.h"
#include "../kernels/reduce.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

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

void StagingBuffers::reserve(MemoryMover& mover, size_t need) {
  if (owner == &mover && bytes >= need) return;
  release();
  for (void*& p : chunk) p = mover.alloc_staging(need);
  bytes = need;
  owner = &mover;
}

void StagingBuffers::release() {
  if (owner)
    for (void*& p : chunk)
      if (p) owner->free_staging(p);
  chunk[0] = chunk[1] = nullptr;
  bytes = 0;
  owner = nullptr;
}

void staged_allreduce(const Buffer& src, const Buffer& dst, MemoryMover& mover, StagingBuffers& staging,
                      size_t chunk_bytes, const std::function<void(const Buffer& host_chunk)>& host_allreduce,
                      bool host_wait) {
  if (src.count == 0) return;
  const size_t esize = kernels::dtype_size(src.dtype);
  const size_t chunk_elems = std::max<size_t>(1, chunk_bytes / esize);
  const size_t chunks = (src.count + chunk_elems - 1) / chunk_elems;
  staging.reserve(mover, std::min(src.count, chunk_elems) * esize);
  auto range = [&](size_t k, size_t* begin, size_t* len) {
    *begin = k * chunk_elems;
    *len = std::min(chunk_elems, src.count - *begin);
  };

  size_t begin, len;
  range(0, &begin, &len);
  mover.to_host_async(staging.chunk[0], src.bytes_at(begin), len * esize, 0);
  for (size_t k = 0; k < chunks; ++k) {
    const int lane = static_cast<int>(k % 2);
    // Chunk k is on the host (and this lane's previous upload, of chunk k-2, is done).
    mover.wait_lane(lane);
    if (k + 1 < chunks) {
      // The other lane's buffer is free once its upload of chunk k-1 has run;
      // lanes run in order, so the download queued behind it waits for it.
      size_t nb, nl;
      range(k + 1, &nb, &nl);
      mover.to_host_async(staging.chunk[1 - lane], src.bytes_at(nb), nl * esize, 1 - lane);
    }
    range(k, &begin, &len);
    Buffer host = src;
    host.data = staging.chunk[lane];
    host.count = len;
    host.device = Device::CPU;
    host.device_index = -1;
    host_allreduce(host);
    mover.to_device_async(dst.bytes_at(begin), staging.chunk[lane], len * esize, lane);
  }
  if (host_wait) {
    mover.wait_lane(0);
    mover.wait_lane(1);
  } else {
    mover.join_lanes();
  }
}

}  // namespace comm
}  // namespace pycomm

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI: MPIX_CUDA_AWARE_SUPPORT, MPIX_Query_cuda_support
#endif

namespace pycomm {
namespace comm {

bool mpi_is_cuda_aware() {
  if (const char* env = std::getenv("PYCOMM_CUDA_AWARE")) {
    if (env[0] == '1') return true;
    if (env[0] == '0') return false;
  }
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

int mpi_library_cuda_support() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1 ? 1 : 0;
#elif defined(MPIX_CUDA_AWARE_SUPPORT)
  return 0;  // Open MPI built without CUDA (the pip wheels): its headers say so
#else
  return -1;
#endif
}

std::string direct_path_refusal(const std::string& what, bool cuda_aware, bool forced_direct, int library_support,
                                const char* env_override) {
  if (!cuda_aware)
    return what + ": " + (forced_direct ? "force_device_direct (PYCOMM_FORCE_DEVICE_DIRECT=1) hands" : "this path hands") +
           " CUDA device pointers to MPI, but this MPI cannot read device memory (not CUDA-aware: "
           "MPIX_Query_cuda_support, or PYCOMM_CUDA_AWARE=0); unset force_device_direct to stage through host memory";
  if (library_support == 0 && env_override && env_override[0] == '1')
    return what + ": PYCOMM_CUDA_AWARE=1 declares this MPI CUDA-aware, but the library was built without CUDA "
                  "support (its mpi-ext.h says so), so it would read CUDA device pointers as host memory; unset "
                  "PYCOMM_CUDA_AWARE (device data is then staged through host memory) or use a CUDA-aware MPI";
  return std::string();
}

#ifndef PYCOMM_WITH_CUDA
std::unique_ptr<MemoryMover> make_cuda_mover(int) {
  throw CommError("pycomm was built without CUDA; reinstall with a CUDA build of torch (PYCOMM_CUDA=1)");
}
#endif

}  // namespace comm
}  // namespace pycomm
