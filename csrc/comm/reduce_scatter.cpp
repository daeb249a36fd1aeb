#include <climits>
#include <cstring>
#include <vector>

#include "algorithms.h"
#include "mpi_types.h"

namespace pycomm {
namespace comm {

// Ring reduce-scatter: the first half of the ring allreduce (RingPass in
// ring_allreduce.cpp, stopped after its reduce-scatter steps). The input is
// copied once into a scratch buffer that the ring reduces in place; the
// segments may differ in size (uneven splits).
// Schedule: N-1 steps; at step t rank r sends segment (r-t-1) mod N to r+1 and
// receives segment (r-t-2) mod N from r-1, adds it to its own copy and sends
// that on at step t+1, so after the last step it holds segment r reduced.
// Cost with equal segments of S/N: (N-1) alpha + (N-1)/N S beta + (N-1)/N S gamma,
// plus one local copy of S (the input stays untouched).
void RingReduceScatter::run(const Buffer& input, void* output, const std::vector<size_t>& segments, ReduceOp op) {
  int rank = 0, size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_rank(comm_, &rank));
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm_, &size));
  const size_t esize = kernels::dtype_size(input.dtype);
  const size_t mine = segments[rank + 1] - segments[rank];
  if (size == 1) {
    if (mine) std::memcpy(output, input.bytes_at(segments[rank]), mine * esize);
    return;
  }
  std::vector<char> scratch(input.bytes());
  if (!scratch.empty()) std::memcpy(scratch.data(), input.data, scratch.size());
  Buffer work = input;
  work.data = scratch.data();
  ring_reduce_scatter_inplace(work, segments, op, comm_, chunk_bytes_);
  if (mine) std::memcpy(output, work.bytes_at(segments[rank]), mine * esize);
}

// MPI's own MPI_Reduce_scatter (the baseline; the choice for small messages).
// fp16/bf16 use pycomm's user-defined MPI ops (fp32 arithmetic, one rounding).
void MpiReduceScatter::run(const Buffer& input, void* output, const std::vector<size_t>& segments, ReduceOp op) {
  int size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm_, &size));
  std::vector<int> counts(static_cast<size_t>(size));
  for (int j = 0; j < size; ++j) {
    const size_t n = segments[j + 1] - segments[j];
    if (n > static_cast<size_t>(INT_MAX))
      throw CommError("reduce_scatter algorithm 'mpi': a segment exceeds MPI's int count; use algorithm 'ring'");
    counts[j] = static_cast<int>(n);
  }
  PYCOMM_MPI_CHECK(MPI_Reduce_scatter(input.data, output, counts.data(), mpi_datatype(input.dtype),
                                      mpi_op(input.dtype, op), comm_));
}

}  // namespace comm
}  // namespace pycomm
