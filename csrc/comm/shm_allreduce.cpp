#include <cstring>

#include "../kernels/reduce.h"
#include "algorithms.h"
#include "shm_window.h"

namespace pycomm {
namespace comm {
namespace shm_detail {

// Copy this rank's data into its segment, then reduce this rank's slice
// [part_begin(count, L, local_rank), ...) over every segment into its own
// segment. On return (after a fence) segment r's slice r holds the node's
// reduction of slice r.
void reduce_scatter_into_segments(const Buffer& buf, ReduceOp op, ShmWindow& shm) {
  const size_t esize = kernels::dtype_size(buf.dtype);
  shm.reserve(buf.bytes());
  std::memcpy(shm.mine(), buf.data, buf.bytes());
  shm.fence();
  const int L = shm.size(), me = shm.rank();
  const size_t begin = part_begin(buf.count, L, me), len = part_size(buf.count, L, me);
  char* dst = shm.mine() + begin * esize;
  for (int k = 1; k < L; ++k) {
    int peer = (me + k) % L;  // start at a different peer on every rank to spread the load
    kernels::reduce_cpu(dst, shm.segment(peer) + begin * esize, len, buf.dtype, op);
  }
  shm.fence();
}

// Copy each rank's reduced slice out of its segment into `buf`, then fence so
// nobody overwrites a segment that a peer is still reading.
void allgather_from_segments(const Buffer& buf, ShmWindow& shm) {
  const size_t esize = kernels::dtype_size(buf.dtype);
  const int L = shm.size();
  for (int k = 0; k < L; ++k) {
    int owner = (shm.rank() + k) % L;
    size_t begin = part_begin(buf.count, L, owner), len = part_size(buf.count, L, owner);
    std::memcpy(buf.bytes_at(begin), shm.segment(owner) + begin * esize, len * esize);
  }
  shm.fence();
}

}  // namespace shm_detail

void shm_allreduce(const Buffer& buf, ReduceOp op, ShmWindow& shm) {
  if (buf.count == 0 || shm.size() == 1) return;
  shm_detail::reduce_scatter_into_segments(buf, op, shm);
  shm_detail::allgather_from_segments(buf, shm);
}

}  // namespace comm
}  // namespace pycomm
