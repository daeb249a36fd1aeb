#include "ps_update.h"

#include <cmath>
#include <stdexcept>

#include "cpu_dispatch.h"

namespace pycomm {
namespace kernels {
namespace {

// One pass over the shard; the template flags drop the unused terms from the loop.
template <bool MOM, int COMP>
PYCOMM_CPU_CLONES void update(float* __restrict w, float* __restrict v, float* __restrict ms,
                              const float* __restrict g, const float* __restrict bak, size_t n, PsUpdate u) {
  simd_for(n, n * 12, [&](size_t i) {
    float gi = g[i], wi = w[i];
    float d = gi + u.weight_decay * wi;
    if (COMP == 1) d += u.lambda * gi * gi * (wi - bak[i]);
    if (COMP == 2) {
      float m2 = u.ms_decay * ms[i] + (1.0f - u.ms_decay) * gi * gi;
      ms[i] = m2;
      d += u.lambda / std::sqrt(m2 + u.eps) * gi * gi * (wi - bak[i]);
    }
    if (MOM) {
      d = u.momentum * v[i] + d;
      v[i] = d;
    }
    w[i] = wi - u.alpha * d;
  });
}

template <bool MOM>
void update_comp(float* w, float* v, float* ms, const float* g, const float* bak, size_t n, const PsUpdate& u) {
  switch (u.comp) {
    case PsCompensation::None: return update<MOM, 0>(w, v, ms, g, bak, n, u);
    case PsCompensation::Constant: return update<MOM, 1>(w, v, ms, g, bak, n, u);
    case PsCompensation::Adaptive: return update<MOM, 2>(w, v, ms, g, bak, n, u);
  }
  throw std::invalid_argument("ps_update_cpu: unknown compensation");
}

}  // namespace

void ps_update_cpu(float* w, float* v, float* ms, const float* g, const float* bak, size_t n, const PsUpdate& u) {
  if (n == 0) return;
  if (u.momentum != 0.0f && v == nullptr) throw std::invalid_argument("ps_update_cpu: momentum needs a buffer v");
  if (u.comp != PsCompensation::None && bak == nullptr)
    throw std::invalid_argument("ps_update_cpu: delay compensation needs the backup w_bak");
  if (u.comp == PsCompensation::Adaptive && ms == nullptr)
    throw std::invalid_argument("ps_update_cpu: adaptive compensation needs the mean square ms");
  if (u.momentum != 0.0f)
    update_comp<true>(w, v, ms, g, bak, n, u);
  else
    update_comp<false>(w, v, ms, g, bak, n, u);
}

double adadelay_alpha(double L, double c, uint64_t t, uint64_t tau) {
  return 1.0 / (L + c * std::sqrt(static_cast<double>(t) + static_cast<double>(tau)));
}

}  // namespace kernels
}  // namespace pycomm
