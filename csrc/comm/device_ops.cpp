// DeviceOps: the shared workspace cache, the table over host memory (the CPU
// kernels), and the CUDA table's stand-in in CPU-only builds.
#include "device_ops.h"

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../kernels/cast.h"
#include "../kernels/cpu_dispatch.h"
#include "../kernels/onebit.h"
#include "common.h"

namespace pycomm {
namespace comm {

DeviceOps::Workspace DeviceOps::workspace(const void* owner, size_t bytes, size_t cache_limit) {
  std::unique_lock<std::mutex> lock(mu_);
  Block& b = blocks_[owner];
  if (b.p && bytes <= b.bytes) return Workspace(this, b.p, false);
  size_t want = std::max(bytes, 2 * b.bytes);
  if (want > cache_limit) want = bytes;
  ++allocations_;
  if (want > cache_limit) {
    // Said once per table; the memory is allocated and freed stream-ordered per call.
    if (uncached_++ == 0)
      std::fprintf(stderr,
                   "pycomm: a compressed allreduce workspace of %zu MiB is above PYCOMM_DEVICE_CACHE_MB=%zu: "
                   "workspaces this large are allocated per call (raise the limit to keep them); said once\n",
                   want >> 20, cache_limit >> 20);
    return Workspace(this, alloc(want), true);
  }
  if (b.p) release(b.p);
  b = Block{};
  b.p = alloc(want);
  b.bytes = want;
  return Workspace(this, b.p, false);
}

uint64_t DeviceOps::workspace_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t total = 0;
  for (const auto& kv : blocks_) total += kv.second.bytes;
  return total;
}

uint64_t DeviceOps::workspace_allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocations_;
}

namespace {

class CpuOps : public DeviceOps {
 public:
  const char* name() const override { return "cpu"; }
  int cast_to_half(const float* x, void* y, size_t n, DType half, float scale) override {
    int bad = 0;
    kernels::cast_to_half_cpu(x, y, n, half, scale, &bad);
    return bad;
  }
  void cast_to_float(const void* x, float* y, size_t n, DType half) override {
    kernels::cast_to_float_cpu(x, y, n, half, 1.0f);
  }
  int any_nonfinite(const float* x, const uint8_t* mask, size_t n) override {
    int bad = 0;
    const int threads = kernels::threads_for(n * sizeof(float));
#pragma omp parallel for reduction(| : bad) schedule(static) num_threads(threads) if (threads > 1)
    for (size_t i = 0; i < n; ++i) bad |= (!(std::fabs(x[i]) <= FLT_MAX) && (!mask || mask[i])) ? 1 : 0;
    return bad;
  }
  int any_nonfinite_half(const void* x, size_t n, DType half) override {
    const uint16_t* v = static_cast<const uint16_t*>(x);
    const uint16_t exp = half == DType::F16 ? 0x7c00u : 0x7f80u;  // exponent all ones
    for (size_t i = 0; i < n; ++i)
      if ((v[i] & exp) == exp) return 1;
    return 0;
  }
  void onebit_compress(const float* x, float* residual, size_t n, size_t chunk, uint8_t* bits, float* scale,
                       const uint8_t* mask) override {
    kernels::onebit_compress_cpu(x, residual, n, chunk, bits, scale, mask);
  }
  void onebit_decompress(const uint8_t* bits, const float* scale, size_t n, size_t chunk, float* out,
                         const uint8_t* mask) override {
    kernels::onebit_decompress_cpu(bits, scale, n, chunk, out, mask);
  }
  void onebit_decompress_accumulate(const uint8_t* bits, const float* scale, size_t n, size_t chunk, float* out,
                                    float weight, const uint8_t* mask) override {
    kernels::onebit_decompress_accumulate_cpu(bits, scale, n, chunk, out, weight, mask);
  }
  void fill_zero(void* p, size_t bytes) override { std::memset(p, 0, bytes); }
  void copy(void* dst, const void* src, size_t bytes) override { std::memmove(dst, src, bytes); }

 protected:
  void* alloc(size_t bytes) override {
    void* p = std::malloc(std::max<size_t>(bytes, 1));
    if (!p) throw CommError("compressed allreduce: out of host memory for its workspace");
    return p;
  }
  void release(void* p) override { std::free(p); }
};

}  // namespace

DeviceOps& cpu_device_ops() {
  static CpuOps* ops = new CpuOps();  // never destroyed: engines may run until exit
  return *ops;
}

WorkspaceStats device_ops_workspace_stats() {
  WorkspaceStats s = cuda_ops_workspace_stats();
  s.bytes += cpu_device_ops().workspace_bytes();
  s.allocations += cpu_device_ops().workspace_allocations();
  return s;
}

#ifndef PYCOMM_WITH_CUDA
DeviceOps& cuda_device_ops(int) {
  throw CommError("pycomm was built without CUDA; reinstall with a CUDA build of torch (PYCOMM_CUDA=1)");
}
WorkspaceStats cuda_ops_workspace_stats() { return {}; }
#endif

}  // namespace comm
}  // namespace pycomm
