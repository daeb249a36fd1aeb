#include <algorithm>

#include "algorithms.h"

namespace pycomm {
namespace comm {

constexpr size_t kMaxBcastBytes = size_t(1) << 30;

void broadcast(const Buffer& buf, int root, MPI_Comm comm) {
  char* base = static_cast<char*>(buf.data);
  const size_t total = buf.bytes();
  for (size_t done = 0; done < total; done += kMaxBcastBytes) {
    int n = static_cast<int>(std::min(kMaxBcastBytes, total - done));
    PYCOMM_MPI_CHECK(MPI_Bcast(base + done, n, MPI_BYTE, root, comm));
  }
}

}  // namespace comm
}  // namespace pycomm
