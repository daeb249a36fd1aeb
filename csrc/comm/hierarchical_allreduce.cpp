#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "../kernels/reduce.h"
#include "algorithms.h"
#include "shm_window.h"
#include "stage_clock.h"
#include "timeline.h"

namespace pycomm {
namespace comm {
namespace shm_detail {
void reduce_scatter_into_segments(const Buffer& buf, ReduceOp op, ShmWindow& shm);
void allgather_from_segments(const Buffer& buf, ShmWindow& shm);
}  // namespace shm_detail

namespace {

void cross_allreduce(const Buffer& shard, ReduceOp op, MPI_Comm comm, bool ring, size_t chunk_bytes) {
  int size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size));
  if (size == 1 || shard.count == 0) return;
  if (ring) ring_allreduce(shard, op, comm, chunk_bytes);
  else mpi_allreduce(shard, op, comm);
}

}  // namespace

void hierarchical_allreduce(const Buffer& buf, ReduceOp op, ShmWindow& shm, MPI_Comm cross, bool cross_ring,
                            size_t chunk_bytes) {
  if (buf.count == 0) return;
  const int L = shm.size(), me = shm.rank();
  if (L == 1) return cross_allreduce(buf, op, cross, cross_ring, chunk_bytes);
  timeline::Phase phase("LOCAL_REDUCE_SCATTER");
  shm_detail::reduce_scatter_into_segments(buf, op, shm);
  phase.next("CROSS_NODE");

  // This rank's shard of the node sum, reduced with the same shard of every other node.
  Buffer shard = buf;
  const size_t begin = part_begin(buf.count, L, me);
  shard.data = shm.mine() + begin * kernels::dtype_size(buf.dtype);
  shard.count = part_size(buf.count, L, me);
  cross_allreduce(shard, op, cross, cross_ring, chunk_bytes);

  stage_clock::StageClock clock;
  shm.fence();  // every shard is final before anyone copies it out
  clock.mark(stage_clock::kBarrier);
  phase.next("LOCAL_ALLGATHER");
  shm_detail::allgather_from_segments(buf, shm);
}

void device_hierarchical_allreduce(const Buffer& buf, ReduceOp op, MPI_Comm local, MPI_Comm cross, size_t chunk_bytes,
                                   MemoryMover& memory) {
  if (buf.count == 0) return;
  // The allgather counts elements of one contiguous type in ints; checked before anything moves.
  if (buf.count > static_cast<size_t>(INT_MAX))
    throw CommError("hierarchical allreduce on device memory: " + std::to_string(buf.count) +
                    " elements exceed MPI's int counts; use algorithm='ring'");
  int L = 1, me = 0, M = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_size(local, &L));
  PYCOMM_MPI_CHECK(MPI_Comm_rank(local, &me));
  PYCOMM_MPI_CHECK(MPI_Comm_size(cross, &M));
  std::vector<size_t> segments;
  for (int j = 0; j <= L; ++j) segments.push_back(part_begin(buf.count, L, j));
  timeline::Phase phase("LOCAL_REDUCE_SCATTER");
  if (L > 1) ring_reduce_scatter_inplace(buf, segments, op, local, chunk_bytes, &memory);

  phase.next("CROSS_NODE");
  Buffer shard = buf;
  shard.data = buf.bytes_at(segments[me]);
  shard.count = segments[me + 1] - segments[me];
  if (M > 1 && shard.count) ring_allreduce(shard, op, cross, chunk_bytes, &memory);
  if (L == 1) return;
  phase.next("LOCAL_ALLGATHER");

  std::vector<int> counts(L), displs(L);
  for (int j = 0; j < L; ++j) {
    counts[j] = static_cast<int>(segments[j + 1] - segments[j]);
    displs[j] = static_cast<int>(segments[j]);
  }
  MPI_Datatype element;
  PYCOMM_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(kernels::dtype_size(buf.dtype)), MPI_BYTE, &element));
  PYCOMM_MPI_CHECK(MPI_Type_commit(&element));
  const int rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf.data, counts.data(), displs.data(), element,
                                local);
  MPI_Type_free(&element);
  PYCOMM_MPI_CHECK(rc);
}

void hierarchical_master_allreduce(const Buffer& buf, ReduceOp op, ShmWindow& shm, MPI_Comm masters,
                                   bool cross_ring, size_t chunk_bytes) {
  if (buf.count == 0) return;
  const int L = shm.size();
  if (L == 1) return cross_allreduce(buf, op, masters, cross_ring, chunk_bytes);
  const size_t esize = kernels::dtype_size(buf.dtype);
  // 1. Reduce to the master. The L ranks each reduce one slice in parallel
  //    (the reduction work is shared), then the master collects the slices.
  shm_detail::reduce_scatter_into_segments(buf, op, shm);
  if (shm.rank() == 0) {
    for (int owner = 1; owner < L; ++owner) {
      size_t begin = part_begin(buf.count, L, owner), len = part_size(buf.count, L, owner);
      std::memcpy(shm.mine() + begin * esize, shm.segment(owner) + begin * esize, len * esize);
    }
    // 2. Allreduce among the node masters, in place in the master's segment.
    Buffer whole = buf;
    whole.data = shm.mine();
    cross_allreduce(whole, op, masters, cross_ring, chunk_bytes);
  }
  // 3. Broadcast inside the node: everyone copies the master's segment.
  shm.fence();
  std::memcpy(buf.data, shm.segment(0), buf.bytes());
  shm.fence();
}

}  // namespace comm
}  // namespace pycomm
