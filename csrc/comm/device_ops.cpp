// DeviceOps: the table over host memory (the CPU kernels), and the CUDA
// table's stand-in in CPU-only builds.
#include "device_ops.h"

#include <cfloat>
#include <cmath>
#include <cstring>

#include "../kernels/cast.h"
#include "../kernels/cpu_dispatch.h"
#include "../kernels/onebit.h"
#include "common.h"

namespace pycomm {
namespace comm {

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
};

}  // namespace

DeviceOps& cpu_device_ops() {
  static CpuOps* ops = new CpuOps();  // never destroyed: engines may run until exit
  return *ops;
}

#ifndef PYCOMM_WITH_CUDA
DeviceOps& cuda_device_ops(int) {
  throw CommError("pycomm was built without CUDA; reinstall with a CUDA build of torch (PYCOMM_CUDA=1)");
}
#endif

}  // namespace comm
}  // namespace pycomm
