// For the .cu files of the engine (internal): make a CUDA device current for a scope and give the
// caller's back. A blocking call on an idle engine runs on the caller's thread, whose current
// device must not change under it (docs/gpu.md, stream rules). No torch or MPI headers.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace pycomm {
namespace comm {

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaError_t rc = cudaGetDevice(&prev_);
    if (rc == cudaSuccess && prev_ != device) rc = cudaSetDevice(device);
    else prev_ = -1;
    if (rc != cudaSuccess) {
      prev_ = -1;
      throw std::runtime_error(std::string("CUDA error in cudaGetDevice/cudaSetDevice: ") + cudaGetErrorString(rc));
    }
  }
  // A destructor cannot throw: a failed restore shows in the caller's next CUDA call.
  ~DeviceScope() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = -1;
};

}  // namespace comm
}  // namespace pycomm
