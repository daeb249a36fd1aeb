// What memory_mover.h declares beside the movers: whether MPI reads device
// memory, and the CUDA mover's stand-in in CPU-only builds (cuda_mover.cu is
// the CUDA one).
#include "memory_mover.h"

#include <cstdlib>
#include <string>

#include <mpi.h>

#include "common.h"

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI: MPIX_CUDA_AWARE_SUPPORT, MPIX_Query_cuda_support
#endif

namespace pycomm {
namespace comm {

bool mpi_is_cuda_aware() {
  if (const char* env = std::getenv("PYCOMM_CUDA_AWARE")) {
    if (env[0] == '1') return true;
    if (env[0] == '0') return false;
  }
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

int mpi_library_cuda_support() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1 ? 1 : 0;
#elif defined(MPIX_CUDA_AWARE_SUPPORT)
  return 0;  // Open MPI built without CUDA (the pip wheels): its headers say so
#else
  return -1;
#endif
}

std::string direct_path_refusal(const std::string& what, bool cuda_aware, bool forced_direct, int library_support,
                                const char* env_override) {
  if (!cuda_aware)
    return what + ": " + (forced_direct ? "force_device_direct (PYCOMM_FORCE_DEVICE_DIRECT=1) hands" : "this path hands") +
           " CUDA device pointers to MPI, but this MPI cannot read device memory (not CUDA-aware: "
           "MPIX_Query_cuda_support, or PYCOMM_CUDA_AWARE=0); unset force_device_direct to stage through host memory";
  if (library_support == 0 && env_override && env_override[0] == '1')
    return what + ": PYCOMM_CUDA_AWARE=1 declares this MPI CUDA-aware, but the library was built without CUDA "
                  "support (its mpi-ext.h says so), so it would read CUDA device pointers as host memory; unset "
                  "PYCOMM_CUDA_AWARE (device data is then staged through host memory) or use a CUDA-aware MPI";
  return std::string();
}

#ifndef PYCOMM_WITH_CUDA
std::unique_ptr<MemoryMover> make_cuda_mover(int) {
  throw CommError("pycomm was built without CUDA; reinstall with a CUDA build of torch (PYCOMM_CUDA=1)");
}
#endif

}  // namespace comm
}  // namespace pycomm
