// Parameter-server update rules, applied by a server to its shard of one
// tensor when a worker's gradient g arrives (docs/algorithms.md §5). float32 only.
//
//   d  = g + wd * w + comp                    comp: DC-ASGD's delay compensation, else 0
//   v  = mu * v + d        (skipped when mu == 0; v may then be null)
//   w  = w - alpha * v     (alpha * d when mu == 0)
//
// comp (Zheng et al. 2017), with w_bak the copy of w that this worker last pulled:
//   constant:  comp = lambda * g * g * (w - w_bak)
//   adaptive:  ms = m * ms + (1 - m) * g * g;  comp = lambda0 / sqrt(ms + eps) * g * g * (w - w_bak)
// AdaDelay (Sra et al. 2015) only changes alpha: adadelay_alpha(L, c, t, tau) = 1 / (L + c sqrt(t + tau)).
#pragma once
#include <cstddef>
#include <cstdint>

namespace pycomm {
namespace kernels {

enum class PsCompensation : int32_t { None = 0, Constant = 1, Adaptive = 2 };

struct PsUpdate {
  float alpha = 0.01f;       // step size
  float momentum = 0.0f;     // mu
  float weight_decay = 0.0f; // wd
  PsCompensation comp = PsCompensation::None;
  float lambda = 0.04f;      // constant lambda, or lambda0 for the adaptive form
  float ms_decay = 0.95f;    // m
  float eps = 1e-7f;
};

// w, g: n floats. v: momentum buffer (needed when momentum != 0). bak: w_bak (needed
// when comp != None). ms: mean square (needed when comp == Adaptive). No aliasing.
void ps_update_cpu(float* w, float* v, float* ms, const float* g, const float* bak, size_t n, const PsUpdate& u);

// AdaDelay's step 1 / (L + c sqrt(t + tau)); t: updates applied so far, tau: the gradient's delay.
double adadelay_alpha(double L, double c, uint64_t t, uint64_t tau);

}  // namespace kernels
}  // namespace pycomm
