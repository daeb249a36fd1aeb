// MemoryMover over CUDA: two streams (the pipeline's lanes) and pinned host
// buffers, so device->host and host->device copies run while the host
// reduces another chunk. No torch or MPI headers.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "memory_mover.h"

namespace pycomm {
namespace comm {
namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(rc));
}

class CudaMover : public MemoryMover {
 public:
  explicit CudaMover(int device) : device_(device) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    for (auto& s : streams_) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaMover() override {
    cudaSetDevice(device_);
    for (auto& s : streams_) cudaStreamDestroy(s);
  }
  void* alloc_staging(size_t bytes) override {
    void* p = nullptr;
    check(cudaMallocHost(&p, bytes ? bytes : 1), "cudaMallocHost");
    return p;
  }
  void free_staging(void* p) override { cudaFreeHost(p); }
  void to_host_async(void* host, const void* src, size_t bytes, int lane) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, streams_[lane & 1]), "cudaMemcpyAsync D2H");
  }
  void to_device_async(void* dst, const void* host, size_t bytes, int lane) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, streams_[lane & 1]), "cudaMemcpyAsync H2D");
  }
  void wait_lane(int lane) override { check(cudaStreamSynchronize(streams_[lane & 1]), "cudaStreamSynchronize"); }

 private:
  int device_;
  cudaStream_t streams_[2] = {nullptr, nullptr};
};

}  // namespace

std::unique_ptr<MemoryMover> make_cuda_mover(int device) { return std::make_unique<CudaMover>(device); }

}  // namespace comm
}  // namespace pycomm
