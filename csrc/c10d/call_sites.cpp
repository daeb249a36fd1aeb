#include "call_sites.h"

#include <algorithm>

namespace pycomm {
namespace c10d_backend {

uint64_t SiteKey::hash() const {
  // FNV-1a over the fields
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(dtype));
  mix(average ? 1 : 0);
  mix(shape.size());
  for (int64_t d : shape) mix(static_cast<uint64_t>(d));
  return h;
}

void CallSites::reset() {
  ring_.clear();
  run_.clear();
  recent_.clear();
  keys_.clear();
  calls_ = 0;
  phase_ = 0;
  fixed_ = false;
}

int64_t CallSites::next(const SiteKey& k) {
  const size_t R = kMaxPeriod + 1;
  if (ring_.empty()) {
    ring_.assign(R, 0);
    run_.assign(kMaxPeriod + 1, 0);
  }
  const uint64_t h = k.hash();
  const uint64_t i = calls_++;
  // run[L] for every candidate period
  for (size_t L = 1; L <= kMaxPeriod && L <= i; ++L) run_[L] = ring_[(i - L) % R] == h ? run_[L] + 1 : 0;
  ring_[i % R] = h;
  recent_.push_back(k);
  if (recent_.size() > 2 * kMaxPeriod) recent_.erase(recent_.begin(), recent_.begin() + kMaxPeriod);

  if (fixed_) {
    if (keys_[phase_] == k) {
      const size_t pos = phase_;
      phase_ = (phase_ + 1) % keys_.size();
      return static_cast<int64_t>(pos);
    }
    fixed_ = false;  // the pattern broke: learn again
    ++breaks_;
  }
  for (size_t L = 1; L <= kMaxPeriod && L <= i; ++L) {
    if (run_[L] < std::max(L, kMinRepeat)) continue;
    // Fix period L: the last L keys (this call last), rotated to start at their least rotation.
    std::vector<SiteKey> last(recent_.end() - static_cast<std::ptrdiff_t>(L), recent_.end());
    std::vector<uint64_t> hs(L);
    for (size_t j = 0; j < L; ++j) hs[j] = last[j].hash();
    size_t best = 0;
    for (size_t s = 1; s < L; ++s)
      for (size_t j = 0; j < L; ++j) {
        const uint64_t a = hs[(s + j) % L], b = hs[(best + j) % L];
        if (a != b) {
          if (a < b) best = s;
          break;
        }
      }
    keys_.clear();
    for (size_t j = 0; j < L; ++j) keys_.push_back(last[(best + j) % L]);
    // this call is last[L-1], at position (L - 1 - best) mod L of the rotation
    const size_t pos = (L - 1 + L - best) % L;
    phase_ = (pos + 1) % L;
    fixed_ = true;
    return static_cast<int64_t>(pos);
  }
  return -1;
}

}  // namespace c10d_backend
}  // namespace pycomm
