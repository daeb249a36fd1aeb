// MemoryMover over CUDA: two streams (the pipeline's lanes) and pinned host
// buffers, so device->host and host->device copies run while the host
// reduces another chunk. No torch or MPI headers.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "../kernels/fusion.h"
#include "../kernels/reduce.h"
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
    drop_cache();
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

  void* alloc_device(size_t bytes) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    void* p = nullptr;
    check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
    return p;
  }
  void free_device(void* p) override { cudaFree(p); }
  void reduce(void* dst, const void* src, size_t count, kernels::DType dtype, kernels::ReduceOp op) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    kernels::reduce_cuda(dst, src, count, dtype, op, streams_[0]);
    check(cudaStreamSynchronize(streams_[0]), "cudaStreamSynchronize (reduce)");
  }
  void scale(void* dst, size_t count, kernels::DType dtype, double factor) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    kernels::scale_cuda(dst, count, dtype, factor, streams_[0]);
    check(cudaStreamSynchronize(streams_[0]), "cudaStreamSynchronize (scale)");
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, streams_[0]), "cudaMemcpyAsync D2D");
    check(cudaStreamSynchronize(streams_[0]), "cudaStreamSynchronize (copy)");
  }
  void pack(const void* const* srcs, const size_t* counts, size_t num, void* flat, kernels::DType dtype) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    kernels::fusion_pack_cuda(srcs, counts, num, flat, dtype, streams_[0]);
    check(cudaStreamSynchronize(streams_[0]), "cudaStreamSynchronize (pack)");
  }
  void unpack(const void* flat, void* const* dsts, const size_t* counts, size_t num, kernels::DType dtype,
              double scale) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    kernels::fusion_unpack_cuda(flat, dsts, counts, num, dtype, scale, streams_[0]);
    check(cudaStreamSynchronize(streams_[0]), "cudaStreamSynchronize (unpack)");
  }
  // Both lanes wait for the producer on the device; the host goes on.
  void wait_event(DeviceEvent& producer) override {
    for (auto& s : streams_) producer.order_stream(s);
  }
  // After both lanes' work: lane 0 waits for lane 1 (one pooled event), then the done event is recorded on lane 0.
  EventPtr record_done() override {
    EventPtr lane1 = record_cuda_event(device_, streams_[1]);
    lane1->order_stream(streams_[0]);
    return record_cuda_event(device_, streams_[0]);
  }

 private:
  int device_;
  cudaStream_t streams_[2] = {nullptr, nullptr};
};

}  // namespace

std::unique_ptr<MemoryMover> make_cuda_mover(int device) { return std::make_unique<CudaMover>(device); }

}  // namespace comm
}  // namespace pycomm
