#include <algorithm>
#include <climits>

#include "algorithms.h"
#include "mpi_types.h"
#include "stage_clock.h"

namespace pycomm {
namespace comm {

// MPI counts are ints: pieces of at most 2^30 elements keep every count legal.
constexpr size_t kMaxMpiCount = size_t(1) << 30;

void mpi_allreduce(const Buffer& buf, ReduceOp op, MPI_Comm comm) {
  MPI_Datatype type = mpi_datatype(buf.dtype);
  MPI_Op mop = mpi_op(buf.dtype, op);
  stage_clock::StageClock clock;  // bytes: the tensor once (what MPI moves inside is its own)
  for (size_t done = 0; done < buf.count; done += kMaxMpiCount) {
    int n = static_cast<int>(std::min(kMaxMpiCount, buf.count - done));
    PYCOMM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf.bytes_at(done), n, type, mop, comm));
  }
  clock.mark(stage_clock::kMpi, buf.bytes());
}

}  // namespace comm
}  // namespace pycomm
