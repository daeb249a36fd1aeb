#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <vector>

#include "algorithms.h"

namespace pycomm {
namespace comm {
namespace {

constexpr size_t kPieceBytes = size_t(1) << 30;

// Test-only: PYCOMM_TEST_ALLGATHER_PIECE_BYTES=P sends every allgather through
// the ring below in pieces of P bytes, so its > 2 GiB logic runs on small data.
size_t test_piece_bytes() {
  const char* raw = std::getenv("PYCOMM_TEST_ALLGATHER_PIECE_BYTES");
  if (!raw || !*raw) return 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(raw, &end, 10);
  if (*end != '\0' || v == 0 || v > kPieceBytes)
    throw CommError(std::string("PYCOMM_TEST_ALLGATHER_PIECE_BYTES=") + raw + " must be an integer in 1..2^30");
  return static_cast<size_t>(v);
}

// Ring allgatherv for totals beyond MPI's int byte counts: N-1 steps, each
// forwarding the block received in the step before, in pieces of `piece`
// bytes. Rank r sends block (r - s) and receives block (r - s - 1) in step s;
// blocks differ in size, so every rank makes the same number of Sendrecv
// calls in a step -- enough for the largest block of that step anywhere --
// with empty pieces once its own blocks are through. (Counting only its own
// two blocks, neighbours would disagree on the count and the pairs would slip.)
void ring_allgatherv(char* out, const std::vector<size_t>& offset, const std::vector<size_t>& bytes, MPI_Comm comm,
                     int rank, int size, size_t piece) {
  const int right = (rank + 1) % size, left = (rank - 1 + size) % size;
  // Every block is sent by some rank in every step: the largest block sets the count.
  const size_t largest = *std::max_element(bytes.begin(), bytes.end());
  const size_t pieces = (largest + piece - 1) / piece;
  for (int step = 0; step < size - 1; ++step) {
    int send_block = ((rank - step) % size + size) % size;
    int recv_block = ((rank - step - 1) % size + size) % size;
    size_t sent = 0, recvd = 0;
    for (size_t p = 0; p < pieces; ++p) {
      int ns = static_cast<int>(std::min(piece, bytes[send_block] - sent));
      int nr = static_cast<int>(std::min(piece, bytes[recv_block] - recvd));
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

  // `send` and `out` may be device memory (CUDA-aware MPI), so the rank's own
  // block is placed by MPI, never by std::memcpy.
  const size_t test_piece = test_piece_bytes();
  if (test_piece == 0 && total * esize <= static_cast<size_t>(INT_MAX)) {
    std::vector<int> icounts(size), idispl(size);
    for (int r = 0; r < size; ++r) {
      icounts[r] = static_cast<int>(bytes[r]);
      idispl[r] = static_cast<int>(offset[r]);
    }
    PYCOMM_MPI_CHECK(MPI_Allgatherv(send, icounts[rank], MPI_BYTE, out, icounts.data(), idispl.data(), MPI_BYTE, comm));
  } else {
    const size_t piece = test_piece ? test_piece : kPieceBytes;
    for (size_t done = 0; done < bytes[rank]; done += piece) {  // own block: a Sendrecv to self, piece by piece
      int n = static_cast<int>(std::min(piece, bytes[rank] - done));
      PYCOMM_MPI_CHECK(MPI_Sendrecv(static_cast<const char*>(send) + done, n, MPI_BYTE, rank, 0x4146,
                                    out + offset[rank] + done, n, MPI_BYTE, rank, 0x4146, comm, MPI_STATUS_IGNORE));
    }
    ring_allgatherv(out, offset, bytes, comm, rank, size, piece);
  }
  return counts;
}

}  // namespace comm
}  // namespace pycomm
