// Error feedback of the onebit compressed allreduce, kept beside the
// scheme rather than inside it: the scheme (compressed_allreduce.h) reads and
// updates two residuals per call, and this store keeps them from one call to
// the next, per key:
//   worker  e_w, n float32 (the tensor's elements): what the worker's sign
//           quantization lost, added back before the next quantization;
//   server  e_s, m = onebit_layout(n, world).chunk float32: the same for this
//           rank's server chunk.
// Its two users: pycomm.compression.OneBit (keys are tensor names, exposed as
// _C.OnebitResiduals) and the c10d backend (keys are call sites,
// process_group_pycomm.h). At a call, a key's residuals are
//   made       zero on the tensor's device, the first time;
//   replaced   by zeros when the call's tag differs (the c10d site's dtype,
//              average and shape: a hash collision, the newer tensor wins);
//   refused    (ValueError) when the tag is the same but the element count is
//              not: a name used for two tensors;
//   reset      the server residual only, to zero, when the world size changed
//              (its chunk belongs to other ranks then);
//   moved      to the tensor's device when they live on another.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "../comm/compressed_allreduce.h"

namespace pycomm {
namespace bindings {

template <class Key, class Tag = int>
class OnebitResiduals {
 public:
  struct Pair {
    at::Tensor worker, server;  // float32[n], float32[chunk of this rank]
    int world = 0;              // the world size the server residual belongs to
    Tag tag{};
  };

  // The residuals `t`'s call under `key` updates (see the file comment). `describe(key)` names the
  // key in the error.
  Pair& for_call(const Key& key, const at::Tensor& t, int world, const Tag& tag = Tag{},
                 const std::function<std::string(const Key&)>& describe = nullptr) {
    const int64_t n = t.numel();
    const int64_t chunk = static_cast<int64_t>(comm::onebit_layout(static_cast<size_t>(n), world).chunk);
    const auto zeros = [&t](int64_t count) { return at::zeros({count}, t.options().dtype(at::kFloat)); };
    auto it = entries_.find(key);
    if (it == entries_.end() || !(it->second.tag == tag)) {
      Pair& p = entries_[key];
      p = Pair{zeros(n), zeros(chunk), world, tag};
      return p;
    }
    Pair& p = it->second;
    if (p.worker.numel() != n) {
      std::ostringstream msg;
      msg << "onebit: tensor '" << (describe ? describe(key) : std::string("?")) << "' has " << n
          << " elements but its residuals were made for " << p.worker.numel();
      throw std::invalid_argument(msg.str());
    }
    if (p.world != world || p.server.numel() != chunk) {
      p.server = zeros(chunk);
      p.world = world;
    }
    if (p.worker.device() != t.device()) p.worker = p.worker.to(t.device());
    if (p.server.device() != t.device()) p.server = p.server.to(t.device());
    return p;
  }

  // Residuals loaded from a checkpoint: kept as given (the next call moves them, or resets the
  // server residual if `world` is not the job's).
  void put(const Key& key, at::Tensor worker, at::Tensor server, int world, const Tag& tag = Tag{}) {
    entries_[key] = Pair{std::move(worker), std::move(server), world, tag};
  }
  const Pair* find(const Key& key) const {
    auto it = entries_.find(key);
    return it == entries_.end() ? nullptr : &it->second;
  }
  void erase(const Key& key) { entries_.erase(key); }
  template <class Pred>
  void erase_if(Pred pred) {
    for (auto it = entries_.begin(); it != entries_.end();) it = pred(it->first) ? entries_.erase(it) : std::next(it);
  }
  void clear() { entries_.clear(); }  // a call in flight keeps its residual tensors alive (its keepalive)
  size_t size() const { return entries_.size(); }
  const std::map<Key, Pair>& entries() const { return entries_; }

 private:
  std::map<Key, Pair> entries_;
};

}  // namespace bindings
}  // namespace pycomm
