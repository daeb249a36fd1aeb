#include <climits>
#include <cstring>
#include <vector>

#include "algorithms.h"

namespace pycomm {
namespace comm {
namespace {

constexpr size_t kPieceBytes = size_t(1) << 30;

// Ring allgatherv for totals beyond MPI's int byte counts: N-1 steps, each
// forwarding the block received in the step before, in pieces of 1 GiB.
void ring_allgatherv(char* out, const std::vector<size_t>& offset, const std::vector<size_t>& bytes, MPI_Comm comm,
                     int rank, int size) {
  const int right = (rank + 1) % size, left = (rank - 1 + size) % size;
  for (int step = 0; step < size - 1; ++step) {
    int send_block = ((rank - step) % size + size) % size;
    int recv_block = ((rank - step - 1) % size + size) % size;
    size_t sent = 0, recvd = 0;
    while (sent < bytes[send_block] || recvd < bytes[recv_block]) {
      int ns = static_cast<int>(std::min(kPieceBytes, bytes[send_block] - sent));
      int nr = static_cast<int>(std::min(kPieceBytes, bytes[recv_block] - recvd));
      PYCOMM_MPI_CHECK(MPI_Sendrecv(out + offset[send_block] + sent, ns, MPI_BYTE, right, 0x4147,
                                    out + offset[recv_block] + recvd, nr, MPI_BYTE, left, 0x4147, comm,
                                    MPI_STATUS_IGNORE));
      sent += static_cast<size_t>(ns);
      recvd += static_cast<size_t>(nr);
    }
  }
}

}  // namespace

std::vector<size_t> allgatherv(const void* send, size_t rows, size_t row_bytes, MPI_Comm comm,
                               const std::function<void*(size_t)>& allocate) {
  int rank = 0, size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size));
  const size_t esize = row_bytes;

  uint64_t mine = rows;
  std::vector<uint64_t> counts64(static_cast<size_t>(size));
  PYCOMM_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_UINT64_T, counts64.data(), 1, MPI_UINT64_T, comm));

  std::vector<size_t> counts(counts64.begin(), counts64.end()), offset(size), bytes(size);
  size_t total = 0;
  for (int r = 0; r < size; ++r) {
    offset[r] = total * esize;
    bytes[r] = counts[r] * esize;
    total += counts[r];
  }
  char* out = static_cast<char*>(allocate(total));
  if (total * esize == 0) return counts;
  std::memcpy(out + offset[rank], send, bytes[rank]);

  if (total * esize <= static_cast<size_t>(INT_MAX)) {
    std::vector<int> icounts(size), idispl(size);
    for (int r = 0; r < size; ++r) {
      icounts[r] = static_cast<int>(bytes[r]);
      idispl[r] = static_cast<int>(offset[r]);
    }
    PYCOMM_MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, icounts.data(), idispl.data(), MPI_BYTE, comm));
  } else {
    ring_allgatherv(out, offset, bytes, comm, rank, size);
  }
  return counts;
}

}  // namespace comm
}  // namespace pycomm
