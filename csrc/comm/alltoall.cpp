#include <algorithm>
#include <cstring>
#include <vector>

#include "algorithms.h"

namespace pycomm {
namespace comm {
namespace {
constexpr int kAlltoallTag = 0x4132;
constexpr size_t kPieceBytes = size_t(1) << 30;  // MPI counts are ints: move blocks in pieces of 1 GiB
}  // namespace

// Pairwise exchange: N-1 steps; at step k rank r sends its block for rank
// (r+k) mod N and receives the block from rank (r-k) mod N, so every step
// pairs each rank with exactly one sender and one receiver (no hot spot), and
// the blocks may differ in size (uneven splits). The own block is a local copy.
// Cost: (N-1) alpha + (S - S_own) beta per rank, S its send bytes.
void PairwiseAlltoall::run(const char* send, const std::vector<size_t>& send_offset,
                           const std::vector<size_t>& send_bytes, char* recv, const std::vector<size_t>& recv_offset,
                           const std::vector<size_t>& recv_bytes) {
  int rank = 0, size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_rank(comm_, &rank));
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm_, &size));
  if (send_bytes[rank] != recv_bytes[rank])
    throw CommError("alltoall: this rank's block to itself differs in size between send and receive");
  if (send_bytes[rank]) std::memcpy(recv + recv_offset[rank], send + send_offset[rank], send_bytes[rank]);
  std::vector<MPI_Request> reqs;
  for (int k = 1; k < size; ++k) {
    const int to = (rank + k) % size, from = (rank - k + size) % size;
    reqs.clear();  // each block in pieces; both sides count the same pieces from the same byte count
    for (size_t got = 0; got < recv_bytes[from]; got += kPieceBytes) {
      reqs.emplace_back();
      PYCOMM_MPI_CHECK(MPI_Irecv(recv + recv_offset[from] + got,
                                 static_cast<int>(std::min(kPieceBytes, recv_bytes[from] - got)), MPI_BYTE, from,
                                 kAlltoallTag, comm_, &reqs.back()));
    }
    for (size_t sent = 0; sent < send_bytes[to]; sent += kPieceBytes) {
      reqs.emplace_back();
      PYCOMM_MPI_CHECK(MPI_Isend(send + send_offset[to] + sent,
                                 static_cast<int>(std::min(kPieceBytes, send_bytes[to] - sent)), MPI_BYTE, to,
                                 kAlltoallTag, comm_, &reqs.back()));
    }
    if (!reqs.empty())
      PYCOMM_MPI_CHECK(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
  }
}

}  // namespace comm
}  // namespace pycomm
