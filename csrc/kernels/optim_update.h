// Fused optimizer updates for LARS and LAMB (docs/algorithms.md §3), float32 on the CPU.
// Each is two passes over one parameter tensor instead of about ten torch ops:
// pass 1 reads what the norms need (sums of squares in double), pass 2 writes
// the update. Memory traffic per element: LARS 2 reads + (3 reads, 2 writes);
// LAMB (4 reads, 2 writes) + (3 reads, 1 write), the Adam direction r being
// recomputed in pass 2 rather than stored.
#pragma once
#include <cstddef>

namespace pycomm {
namespace kernels {

struct LarsParams {
  float lr, momentum, weight_decay, trust_coefficient, eps;
  bool adapt;  // false: excluded tensor (no LARS scaling; the caller passes weight_decay 0)
};

// local = adapt && ||w||>0 && ||g||>0 ? eta ||w|| / (||g|| + wd ||w|| + eps) : 1
// buf <- m buf + lr local (g + wd w);  w <- w - buf.  Returns local.
float lars_update_cpu(float* w, const float* g, float* buf, size_t n, const LarsParams& p);

struct LambParams {
  float lr, beta1, beta2, eps, weight_decay;
  float one_minus_beta1, one_minus_beta2;  // computed in double by the caller: 1 - float(0.999) is off by 1e-5
  float bias_correction1, bias_correction2;  // 1 - b^t, or 1 without bias correction
  float clamp_lo, clamp_hi;
  bool adapt;  // false: excluded tensor (trust 1; the caller passes weight_decay 0)
};

// m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2;  r = (m/c1) / (sqrt(v/c2) + eps) + wd w
// trust = adapt && ||w||>0 && ||r||>0 ? clamp(||w||, lo, hi) / ||r|| : 1;  w <- w - lr trust r.  Returns trust.
float lamb_update_cpu(float* w, const float* g, float* m, float* v, size_t n, const LambParams& p);

}  // namespace kernels
}  // namespace pycomm
