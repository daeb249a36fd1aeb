// The collective algorithms. Each runs synchronously on the calling thread
// (the engine's worker) over one communicator, in place on host memory.
#pragma once
#include <mpi.h>

#include <functional>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {

// Ring allreduce: reduce-scatter then allgather, 2(N-1) steps of S/N bytes.
// Each step is cut into chunks of `chunk_bytes`; a chunk is forwarded as soon
// as it has been received (and reduced), so receive, reduce and send overlap.
// Cost: 2(N-1) alpha + 2(N-1)/N S beta + (N-1)/N S gamma.
void ring_allreduce(const Buffer& buf, ReduceOp op, MPI_Comm comm, size_t chunk_bytes);

// MPI's own MPI_Allreduce(MPI_IN_PLACE, ...): the baseline, and the choice for small messages.
void mpi_allreduce(const Buffer& buf, ReduceOp op, MPI_Comm comm);

// MPI_Bcast from `root`, split into pieces whose counts fit an int.
void broadcast(const Buffer& buf, int root, MPI_Comm comm);

// Gather every rank's `rows` rows of `row_bytes` each (row counts may differ per
// rank) into one buffer in rank order. `allocate(total_rows)` is called once
// and returns the output memory. Returns the per-rank row counts.
std::vector<size_t> allgatherv(const void* send, size_t rows, size_t row_bytes, MPI_Comm comm,
                               const std::function<void*(size_t)>& allocate);

}  // namespace comm
}  // namespace pycomm
