// Shared pieces of the collective engine: errors, MPI return-code checks,
// buffer descriptors and the communicators the engine runs on.
#pragma once
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../kernels/dtype.h"

namespace pycomm {
namespace comm {

using kernels::DType;
using kernels::ReduceOp;

// Raised for failures of communication itself and for ranks that disagree.
// The bindings map it onto the Python exception pycomm.CommError.
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& what) : std::runtime_error(what) {}
};

[[noreturn]] void throw_mpi_error(int rc, const char* call, const char* file, int line);

#define PYCOMM_MPI_CHECK(call)                                                         \
  do {                                                                                 \
    int pycomm_rc_ = (call);                                                           \
    if (pycomm_rc_ != MPI_SUCCESS) ::pycomm::comm::throw_mpi_error(pycomm_rc_, #call, __FILE__, __LINE__); \
  } while (0)

// Where a buffer lives. The engine never dereferences device memory on the host.
enum class Device : int32_t { CPU = 0, CUDA = 1 };

struct Buffer {
  void* data = nullptr;
  size_t count = 0;  // elements
  DType dtype = DType::F32;
  Device device = Device::CPU;
  int device_index = -1;

  size_t bytes() const { return count * kernels::dtype_size(dtype); }
  char* bytes_at(size_t element) const { return static_cast<char*>(data) + element * kernels::dtype_size(dtype); }
};

// Where an uncompressed average over N ranks scales by 1/N. fp16/bf16 scale every input before
// the sum: N values near the top of the fp16 range overflow before a later scaling could
// rescue them. float32/float64 scale the reduced sum once; x * (1/N) is not always the correctly
// rounded x / N, which is why pycomm.horovod's Average sums and divides afterwards
// (docs/compatibility.md). Integer tensors have no average (the bindings and the c10d backend
// refuse one). A factor of 1 means "no pass".
struct AverageRule {
  double before = 1.0;  // applied to each rank's input
  double after = 1.0;   // applied to the reduced result

  static AverageRule of(bool average, DType dtype, int ranks) {
    AverageRule r;
    if (!average || ranks <= 1) return r;
    const double inv_n = 1.0 / static_cast<double>(ranks);
    if (dtype == DType::F16 || dtype == DType::BF16) r.before = inv_n;
    else r.after = inv_n;
    return r;
  }
};

// The communicators of one job, created by the Python runtime with mpi4py and
// handed over as Fortran handles. `world` is a private duplicate of
// MPI_COMM_WORLD, so user traffic on COMM_WORLD never matches ours.
struct Topology {
  MPI_Comm world = MPI_COMM_NULL;
  MPI_Comm local = MPI_COMM_NULL;  // ranks of this node (shared-memory split or virtual node)
  MPI_Comm cross = MPI_COMM_NULL;  // ranks with the same local rank, one per node
  int rank = 0, size = 1;
  int local_rank = 0, local_size = 1;
  int node_rank = 0, num_nodes = 1;
};

// Split [0, count) into `parts` contiguous pieces whose sizes differ by at most one.
inline size_t part_begin(size_t count, int parts, int i) {
  size_t base = count / static_cast<size_t>(parts), rem = count % static_cast<size_t>(parts);
  size_t ui = static_cast<size_t>(i);
  return ui * base + (ui < rem ? ui : rem);
}
inline size_t part_size(size_t count, int parts, int i) {
  return part_begin(count, parts, i + 1) - part_begin(count, parts, i);
}

}  // namespace comm
}  // namespace pycomm
