// Fused LARS / LAMB updates (see optim_update.h for the math and the traffic).
#include "optim_update.h"

#include <algorithm>
#include <cmath>

#include "cpu_dispatch.h"

namespace pycomm {
namespace kernels {
namespace {

// OpenMP above kParallelMinBytes of one operand; the reductions are in double.
// Below it a plain simd loop (see simd_for: the construct's serial fallback is not vectorized).
PYCOMM_CPU_CLONES void sumsq2(const float* a, const float* b, size_t n, double* sa, double* sb) {
  double x = 0.0, y = 0.0;
  if (n * 4 < kParallelMinBytes) {
#pragma omp simd reduction(+ : x, y)
    for (size_t i = 0; i < n; ++i) {
      x += double(a[i]) * double(a[i]);
      y += double(b[i]) * double(b[i]);
    }
  } else {
#pragma omp parallel for simd schedule(static) reduction(+ : x, y) num_threads(threads_for(n * 4))
    for (size_t i = 0; i < n; ++i) {
      x += double(a[i]) * double(a[i]);
      y += double(b[i]) * double(b[i]);
    }
  }
  *sa = x;
  *sb = y;
}

PYCOMM_CPU_CLONES void lars_apply(float* w, const float* g, float* buf, size_t n, float m, float scale, float wd) {
  simd_for(n, n * 4, [&](size_t i) {
    const float v = m * buf[i] + scale * (g[i] + wd * w[i]);
    buf[i] = v;
    w[i] -= v;
  });
}

// Moments update plus the sums of squares of w and r.
PYCOMM_CPU_CLONES void lamb_moments(const float* w, const float* g, float* m, float* v, size_t n,
                                    const LambParams& p, double* sw, double* sr) {
  const float b1 = p.beta1, b2 = p.beta2, a1 = p.one_minus_beta1, a2 = p.one_minus_beta2;
  const float ic1 = 1.0f / p.bias_correction1, ic2 = 1.0f / p.bias_correction2, eps = p.eps, wd = p.weight_decay;
  auto step = [&](size_t i, double& x, double& y) __attribute__((always_inline)) {
    const float mi = b1 * m[i] + a1 * g[i];
    const float vi = b2 * v[i] + a2 * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    const float r = (mi * ic1) / (std::sqrt(vi * ic2) + eps) + wd * w[i];
    x += double(w[i]) * double(w[i]);
    y += double(r) * double(r);
  };
  double x = 0.0, y = 0.0;
  if (n * 4 < kParallelMinBytes) {  // see sumsq2
#pragma omp simd reduction(+ : x, y)
    for (size_t i = 0; i < n; ++i) step(i, x, y);
  } else {
#pragma omp parallel for simd schedule(static) reduction(+ : x, y) num_threads(threads_for(n * 4))
    for (size_t i = 0; i < n; ++i) step(i, x, y);
  }
  *sw = x;
  *sr = y;
}

PYCOMM_CPU_CLONES void lamb_apply(float* w, const float* m, const float* v, size_t n, const LambParams& p,
                                  float step) {
  const float ic1 = 1.0f / p.bias_correction1, ic2 = 1.0f / p.bias_correction2, eps = p.eps, wd = p.weight_decay;
  simd_for(n, n * 4, [&](size_t i) {
    const float r = (m[i] * ic1) / (std::sqrt(v[i] * ic2) + eps) + wd * w[i];
    w[i] -= step * r;
  });
}

}  // namespace

float lars_update_cpu(float* w, const float* g, float* buf, size_t n, const LarsParams& p) {
  float local = 1.0f;
  if (p.adapt) {
    double sw = 0.0, sg = 0.0;
    sumsq2(w, g, n, &sw, &sg);
    const double wn = std::sqrt(sw), gn = std::sqrt(sg);
    if (wn > 0.0 && gn > 0.0)
      local = static_cast<float>(p.trust_coefficient * wn / (gn + p.weight_decay * wn + p.eps));
  }
  lars_apply(w, g, buf, n, p.momentum, p.lr * local, p.weight_decay);
  return local;
}

float lamb_update_cpu(float* w, const float* g, float* m, float* v, size_t n, const LambParams& p) {
  double sw = 0.0, sr = 0.0;
  lamb_moments(w, g, m, v, n, p, &sw, &sr);
  float trust = 1.0f;
  if (p.adapt) {
    const double wn = std::sqrt(sw), rn = std::sqrt(sr);
    if (wn > 0.0 && rn > 0.0)
      trust = static_cast<float>(std::min<double>(std::max<double>(wn, p.clamp_lo), p.clamp_hi) / rn);
  }
  lamb_apply(w, m, v, n, p, p.lr * trust);
  return trust;
}

}  // namespace kernels
}  // namespace pycomm
