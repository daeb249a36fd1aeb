#include "staging.h"

#include "../kernels/fusion.h"
#include "../kernels/reduce.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace pycomm {
namespace comm {

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
