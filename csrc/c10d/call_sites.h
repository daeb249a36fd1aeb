// Call sites of the backend's compressed allreduces: which error-feedback
// residual an allreduce uses when PYCOMM_COMPRESSION=onebit.
//
// torch.distributed passes no name with an allreduce, so the call site is
// derived from the order of the calls. Training repeats the same sequence of
// allreduces every step (DDP: one per bucket, in bucket order), so the keys
// k_i = (dtype, op, shape) of the calls become periodic with period L = the
// number of compressed allreduces per step, and the site of a call is its
// position in that period: the j-th allreduce of a step meets the residual
// it left one step earlier, even when several buckets share a shape.
//
// Learning (identical on every rank: it depends only on the keys). For every
// candidate L <= kMaxPeriod, run[L] counts the consecutive latest calls with
// k_i == k_{i-L}. The period is fixed at the smallest L with
// run[L] >= max(L, 4): the last 2L calls (and at least 4) repeat. Positions
// are counted from the period's least rotation (by key hash), so they do not
// depend on where learning started. A fixed period is checked on every call;
// a call that breaks it (DDP rebuilding its buckets, an extra allreduce)
// returns to learning. While learning, a call's site is its key alone (one
// residual per key, shared by every learning call of that shape), so a first
// step, or the calls after a break, still get error feedback, only mixed
// among same-shape calls. A run of 4 or more same-key calls in a row is
// taken for a period of 1 until a different call breaks it: such calls share
// a site, consistently from step to step.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pycomm {
namespace c10d_backend {

struct SiteKey {
  int32_t dtype = 0;
  bool average = false;
  std::vector<int64_t> shape;
  bool operator==(const SiteKey& o) const { return dtype == o.dtype && average == o.average && shape == o.shape; }
  bool operator!=(const SiteKey& o) const { return !(*this == o); }
  uint64_t hash() const;
};

class CallSites {
 public:
  static constexpr size_t kMaxPeriod = 1024;
  static constexpr size_t kMinRepeat = 4;

  // The site of the next call, whose key is `k`: its position in the fixed
  // period, or -1 while learning (the site is then the key alone).
  int64_t next(const SiteKey& k);
  void reset();

  size_t period() const { return fixed_ ? keys_.size() : 0; }
  uint64_t breaks() const { return breaks_; }

 private:
  std::vector<uint64_t> ring_;  // hashes of the last kMaxPeriod + 1 calls
  std::vector<uint32_t> run_;   // run_[L]
  uint64_t calls_ = 0;
  // the fixed period: keys from the least rotation on, and the position of the next call
  std::vector<SiteKey> keys_;
  size_t phase_ = 0;
  bool fixed_ = false;
  uint64_t breaks_ = 0;
  std::vector<SiteKey> recent_;  // the last kMaxPeriod keys (to build keys_ when fixing)
};

}  // namespace c10d_backend
}  // namespace pycomm
