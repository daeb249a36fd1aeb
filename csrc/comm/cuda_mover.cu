// MemoryMover over CUDA: two streams (the pipeline's lanes) and pinned host
// buffers, so device->host and host->device copies run while the host
// reduces another chunk. No torch or MPI headers. Stream rules: docs/gpu.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>
#include <stdexcept>
#include <string>

#include "../kernels/fusion.h"
#include "../kernels/reduce.h"
#include "device_scope_cuda.h"
#include "memory_mover.h"

namespace pycomm {
namespace comm {
namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(rc));
}

using Lanes = std::array<cudaStream_t, 2>;

// The lanes' streams are never destroyed: the bindings record submitted tensors on them
// (recordStream), and torch's caching allocator records an event on every recorded stream when
// such a tensor is freed, which may be after this engine stopped (a group destroyed, an elastic
// rebuild, a residual freed at interpreter exit). A stopped mover's pair goes back to this pool
// and the next mover on the device takes it, so the count is bounded by the movers alive at once.
class LanePool {
 public:
  Lanes take(int device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& pairs = free_lanes_[device];
      if (!pairs.empty()) {
        Lanes lanes = pairs.back();
        pairs.pop_back();
        return lanes;
      }
    }
    Lanes lanes{};
    for (auto& s : lanes) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    return lanes;
  }
  void give_back(int device, const Lanes& lanes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_lanes_[device].push_back(lanes);
  }

 private:
  std::mutex mu_;
  std::map<int, std::vector<Lanes>> free_lanes_;
};

// Leaked on purpose, as the streams are: no destructor runs at exit, after the CUDA runtime's.
LanePool& lane_pool() {
  static LanePool* pool = new LanePool;
  return *pool;
}

// The peer path's memory on a GPU (peer_memory.h): blocks from cudaMalloc (memory from cudaMallocAsync's
// pools cannot be exported this way) shared as CUDA IPC handles, signals as interprocess events, the
// work on the mover's lane 0. Blocks are allocated and freed only when the peer allreduce regrows them.
class CudaPeerMemory : public PeerMemory {
 public:
  CudaPeerMemory(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaPeerMemory() override {
    cudaSetDevice(device_);
    for (cudaEvent_t e : own_signals_)
      if (e) cudaEventDestroy(e);
  }
  const char* kind() const override { return "CUDA IPC"; }

  void* export_block(size_t bytes, Handle* handle) override {
    static_assert(sizeof(cudaIpcMemHandle_t) <= kHandleBytes, "a CUDA IPC handle must fit a PeerMemory::Handle");
    DeviceScope on(device_);
    void* p = nullptr;
    check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc (peer block)");
    cudaIpcMemHandle_t h;
    const cudaError_t rc = cudaIpcGetMemHandle(&h, p);
    if (rc != cudaSuccess) {
      cudaFree(p);
      check(rc, "cudaIpcGetMemHandle");
    }
    std::memcpy(handle->bytes, &h, sizeof h);
    return p;
  }
  void unpublish(const Handle&) override {}
  void release_block(void* block, size_t) override {
    DeviceScope on(device_);
    cudaStreamSynchronize(stream_);
    cudaFree(block);
  }
  void* open_block(const Handle& handle, size_t) override {
    DeviceScope on(device_);
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.bytes, sizeof h);
    void* p = nullptr;
    const cudaError_t rc = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (rc != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      throw std::runtime_error(std::string("cudaIpcOpenMemHandle on cuda:") + std::to_string(device_) + ": " +
                               cudaGetErrorString(rc));
    }
    return p;
  }
  void close_block(void* block, size_t) override {
    DeviceScope on(device_);
    cudaIpcCloseMemHandle(block);
  }

  void export_signals(Handle handles[kSignals]) override {
    static_assert(sizeof(cudaIpcEventHandle_t) <= kHandleBytes, "a CUDA IPC event handle must fit a PeerMemory::Handle");
    DeviceScope on(device_);
    for (int k = 0; k < kSignals; ++k) {
      check(cudaEventCreateWithFlags(&own_signals_[k], cudaEventDisableTiming | cudaEventInterprocess),
            "cudaEventCreate (interprocess)");
      cudaIpcEventHandle_t h;
      check(cudaIpcGetEventHandle(&h, own_signals_[k]), "cudaIpcGetEventHandle");
      std::memcpy(handles[k].bytes, &h, sizeof h);
    }
  }
  void* open_signal(const Handle& handle) override {
    DeviceScope on(device_);
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.bytes, sizeof h);
    cudaEvent_t e = nullptr;
    check(cudaIpcOpenEventHandle(&e, h), "cudaIpcOpenEventHandle");
    return e;
  }
  void close_signal(void* signal) override {
    DeviceScope on(device_);
    cudaEventDestroy(static_cast<cudaEvent_t>(signal));
  }
  void signal(int k) override {
    DeviceScope on(device_);
    check(cudaEventRecord(own_signals_[k], stream_), "cudaEventRecord (peer signal)");
  }
  void wait_signal(void* opened) override {
    DeviceScope on(device_);
    check(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(opened), 0), "cudaStreamWaitEvent (peer signal)");
  }

  // Peer blocks are device pointers of this process (cudaIpcOpenMemHandle), so kernels read them as
  // their own; cudaMemcpyDefault lets the driver pick the route between devices.
  void copy(void* dst, const void* src, size_t bytes) override {
    DeviceScope on(device_);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync (peer)");
  }
  void reduce(void* dst, const void* src, size_t count, kernels::DType dtype, kernels::ReduceOp op) override {
    DeviceScope on(device_);
    kernels::reduce_cuda(dst, src, count, dtype, op, stream_);
  }
  void scale(void* dst, size_t count, kernels::DType dtype, double factor) override {
    DeviceScope on(device_);
    kernels::scale_cuda(dst, count, dtype, factor, stream_);
  }
  void synchronize() override { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (peer)"); }

 private:
  int device_;
  cudaStream_t stream_;
  cudaEvent_t own_signals_[kSignals] = {};
};

// Device work is ordered by the two lanes (streams) and events between them; the host waits only
// where the staging pipeline hands host chunks to MPI (wait_lane) and where the direct path's
// reductions are read by MPI next (reduce/scale/copy).
class CudaMover : public MemoryMover {
 public:
  explicit CudaMover(int device) : device_(device) {
    DeviceScope on(device_);
    streams_ = lane_pool().take(device_);
    check(cudaEventCreateWithFlags(&lane_event_, cudaEventDisableTiming), "cudaEventCreate");
    for (auto& t : tables_) check(cudaEventCreateWithFlags(&t.used, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~CudaMover() override {
    cudaSetDevice(device_);
    for (auto& s : streams_) cudaStreamSynchronize(s);
    drop_cache();
    for (auto& t : tables_) {
      if (t.host) cudaFreeHost(t.host);
      if (t.device) cudaFree(t.device);
      cudaEventDestroy(t.used);
    }
    cudaEventDestroy(lane_event_);
    lane_pool().give_back(device_, streams_);
  }
  void* alloc_staging(size_t bytes) override {
    void* p = nullptr;
    check(cudaMallocHost(&p, bytes ? bytes : 1), "cudaMallocHost");
    return p;
  }
  void free_staging(void* p) override { cudaFreeHost(p); }
  void to_host_async(void* host, const void* src, size_t bytes, int lane) override {
    DeviceScope on(device_);
    check(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, streams_[lane & 1]), "cudaMemcpyAsync D2H");
  }
  void to_device_async(void* dst, const void* host, size_t bytes, int lane) override {
    DeviceScope on(device_);
    check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, streams_[lane & 1]), "cudaMemcpyAsync H2D");
  }
  void wait_lane(int lane) override { check(cudaStreamSynchronize(streams_[lane & 1]), "cudaStreamSynchronize"); }
  void* lane_stream(int lane) const override { return streams_[lane & 1]; }
  void join_lanes() override {
    DeviceScope on(device_);
    lane_order(1, 0);
  }

  // Stream-ordered on lane 0 (cudaMallocAsync/cudaFreeAsync: from the device's memory pool, no
  // device-wide synchronisation). The caches (memory_mover.h) call these only when they grow and
  // for requests above their limit; by then everything on lane 1 is joined into lane 0 (the
  // engine's record_done at the end of every operation).
  void* alloc_device(size_t bytes) override {
    DeviceScope on(device_);
    void* p = nullptr;
    check(cudaMallocAsync(&p, bytes ? bytes : 1, streams_[0]), "cudaMallocAsync");
    // Usable from any stream, and by a CUDA-aware MPI, once lane 0 has reached it (growth only).
    check(cudaStreamSynchronize(streams_[0]), "cudaStreamSynchronize (allocation)");
    return p;
  }
  void free_device(void* p) override {
    // From destructors (Lease, drop_cache): must not throw, and gives the caller's device back.
    int prev = -1;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    lane_order_nothrow(1, 0);
    cudaFreeAsync(p, streams_[0]);
    if (prev >= 0 && prev != device_) cudaSetDevice(prev);
  }
  // The direct path's reductions: MPI reads the result next, so the host waits for it.
  void reduce(void* dst, const void* src, size_t count, kernels::DType dtype, kernels::ReduceOp op) override {
    DeviceScope on(device_);
    kernels::reduce_cuda(dst, src, count, dtype, op, streams_[0]);
    check(cudaStreamSynchronize(streams_[0]), "cudaStreamSynchronize (reduce)");
  }
  void scale(void* dst, size_t count, kernels::DType dtype, double factor) override {
    DeviceScope on(device_);
    kernels::scale_cuda(dst, count, dtype, factor, streams_[0]);
    check(cudaStreamSynchronize(streams_[0]), "cudaStreamSynchronize (scale)");
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    DeviceScope on(device_);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, streams_[0]), "cudaMemcpyAsync D2D");
    check(cudaStreamSynchronize(streams_[0]), "cudaStreamSynchronize (copy)");
  }
  // Pack on lane 0, then lane 1 waits for it on the device (the staging pipeline downloads on both).
  void pack(const void* const* srcs, const size_t* counts, size_t num, void* flat, kernels::DType dtype) override {
    DeviceScope on(device_);
    Table& t = table_for(0, kernels::fusion_table_bytes(counts, num, dtype));
    kernels::fusion_pack_cuda(srcs, counts, num, flat, dtype, t.host, t.device, streams_[0]);
    check(cudaEventRecord(t.used, streams_[0]), "cudaEventRecord");
    lane_order(0, 1);
  }
  // After everything on both lanes (the staged uploads), on lane 0; record_done() follows it.
  void unpack(const void* flat, void* const* dsts, const size_t* counts, size_t num, kernels::DType dtype,
              double scale) override {
    DeviceScope on(device_);
    lane_order(1, 0);
    Table& t = table_for(1, kernels::fusion_table_bytes(counts, num, dtype));
    kernels::fusion_unpack_cuda(flat, dsts, counts, num, dtype, scale, t.host, t.device, streams_[0]);
    check(cudaEventRecord(t.used, streams_[0]), "cudaEventRecord");
  }
  std::unique_ptr<PeerMemory> peer_memory() override { return std::make_unique<CudaPeerMemory>(device_, streams_[0]); }
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
  // Stream `to` waits for everything issued on stream `from` so far (device side only).
  void lane_order(int from, int to) {
    check(cudaEventRecord(lane_event_, streams_[from]), "cudaEventRecord (lanes)");
    check(cudaStreamWaitEvent(streams_[to], lane_event_, 0), "cudaStreamWaitEvent (lanes)");
  }
  void lane_order_nothrow(int from, int to) {
    if (cudaEventRecord(lane_event_, streams_[from]) == cudaSuccess) cudaStreamWaitEvent(streams_[to], lane_event_, 0);
  }
  // The fusion piece tables, one for pack and one for unpack: pinned host and device copies kept
  // between calls, regrown (doubling) only when a batch has more pieces than any before. A host
  // table is rewritten once its previous kernel has run (`used`): that was a whole batch earlier,
  // and the staging pipeline's host waits on lane 0 have passed it since, so this does not block.
  struct Table {
    void* host = nullptr;
    void* device = nullptr;
    size_t bytes = 0;
    cudaEvent_t used = nullptr;
  };
  Table& table_for(int which, size_t bytes) {
    Table& t = tables_[which];
    if (bytes > t.bytes) {
      const size_t want = std::max(bytes, 2 * t.bytes);
      check(cudaEventSynchronize(t.used), "cudaEventSynchronize (table regrowth)");
      if (t.host) check(cudaFreeHost(t.host), "cudaFreeHost");
      if (t.device) check(cudaFreeAsync(t.device, streams_[0]), "cudaFreeAsync");
      t.host = t.device = nullptr;
      t.bytes = 0;
      check(cudaMallocHost(&t.host, want), "cudaMallocHost (fusion table)");
      check(cudaMallocAsync(&t.device, want, streams_[0]), "cudaMallocAsync (fusion table)");
      t.bytes = want;
    } else {
      check(cudaEventSynchronize(t.used), "cudaEventSynchronize (fusion table)");
    }
    return t;
  }

  int device_;
  Lanes streams_{};  // from lane_pool(), returned to it (never destroyed)
  cudaEvent_t lane_event_ = nullptr;
  Table tables_[2];
};

}  // namespace

std::unique_ptr<MemoryMover> make_cuda_mover(int device) { return std::make_unique<CudaMover>(device); }

}  // namespace comm
}  // namespace pycomm
