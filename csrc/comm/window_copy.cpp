#include "window_copy.h"

#include <array>
#include <atomic>
#include <cstring>

#include "../kernels/fusion.h"
#include "../kernels/stream_copy.h"
#include "common.h"

namespace pycomm {
namespace comm {
namespace window_copy {
namespace {

// Below this a call is a few microseconds, its time too noisy to choose by; it copies cached.
constexpr size_t kMeasuredMinBytes = size_t(16) << 10;
constexpr uint32_t kFirstTry = 4, kLastTry = 1024;
constexpr double kWeight = 0.25;     // of the newest call in the recent time
constexpr double kHysteresis = 0.9;  // the other method must be 10% cheaper to take over

std::atomic<int> g_stores{static_cast<int>(Stores::AUTO)};
std::atomic<uint64_t> g_cached{0}, g_streamed{0}, g_switches{0};

// One size class's state: 16-256 KiB, 256 KiB-4 MiB, above (time per byte differs with the size).
struct Choice {
  std::array<double, 2> ns_per_byte{0.0, 0.0};  // recent time of calls with cached (0) and streaming (1) stores
  int current = 0;                              // the method in use
  uint32_t since_try = 0, try_every = kFirstTry;
  bool trying = false;
};

Choice& choice_for(size_t bytes) {
  thread_local std::array<Choice, 3> choices;
  return choices[bytes < (size_t(256) << 10) ? 0 : bytes < (size_t(4) << 20) ? 1 : 2];
}

}  // namespace

WindowCall::WindowCall(size_t message_bytes) : bytes_(message_bytes) {
  const auto s = static_cast<Stores>(g_stores.load(std::memory_order_relaxed));
  if (s != Stores::AUTO || message_bytes < kMeasuredMinBytes) {
    streaming_ = s == Stores::STREAMING;
    return;
  }
  Choice& c = choice_for(message_bytes);
  c.trying = ++c.since_try >= c.try_every;
  streaming_ = (c.trying ? 1 - c.current : c.current) == 1;
  measured_ = true;
  began_ = std::chrono::steady_clock::now();
}

void WindowCall::copy(void* dst, const void* src, size_t bytes) const {
  if (streaming_) {
    kernels::stream_copy_cpu(dst, src, bytes);
    g_streamed.fetch_add(bytes, std::memory_order_relaxed);
  } else {
    std::memcpy(dst, src, bytes);
    g_cached.fetch_add(bytes, std::memory_order_relaxed);
  }
}

void WindowCall::pack(const void* const* srcs, const size_t* counts, size_t num, char* dst,
                      kernels::DType dtype) const {
  const size_t esize = kernels::dtype_size(dtype);
  if (streaming_) {
    for (size_t k = 0; k < num; dst += counts[k++] * esize) copy(dst, srcs[k], counts[k] * esize);
    return;
  }
  kernels::fusion_pack_cpu(srcs, counts, num, dst, dtype);
  size_t total = 0;
  for (size_t k = 0; k < num; ++k) total += counts[k];
  g_cached.fetch_add(total * esize, std::memory_order_relaxed);
}

void WindowCall::finish() {
  if (!measured_) return;
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - began_).count();
  Choice& c = choice_for(bytes_);
  double& cost = c.ns_per_byte[streaming_ ? 1 : 0];
  const double sample = ns / static_cast<double>(bytes_);
  // A try replaces what is known of the other method: that may be old, or from the call that
  // first touched a newly allocated window.
  cost = cost == 0.0 || c.trying ? sample : (1 - kWeight) * cost + kWeight * sample;
  const double other = c.ns_per_byte[static_cast<size_t>(1 - c.current)];
  const bool take_other = other > 0.0 && other < kHysteresis * c.ns_per_byte[static_cast<size_t>(c.current)];
  if (c.trying) {
    c.since_try = 0;
    c.try_every = take_other ? kFirstTry : std::min(2 * c.try_every, kLastTry);
  }
  if (take_other) {
    c.current = 1 - c.current;
    g_switches.fetch_add(1, std::memory_order_relaxed);
  }
}

void set_stores(Stores stores) { g_stores.store(static_cast<int>(stores), std::memory_order_relaxed); }
Stores stores() { return static_cast<Stores>(g_stores.load(std::memory_order_relaxed)); }

Stores parse_stores(const std::string& name) {
  if (name == "auto") return Stores::AUTO;
  if (name == "cached") return Stores::CACHED;
  if (name == "streaming") return Stores::STREAMING;
  throw CommError("window stores '" + name + "': choose auto, cached or streaming");
}

Totals totals() {
  return Totals{g_cached.load(std::memory_order_relaxed), g_streamed.load(std::memory_order_relaxed),
                g_switches.load(std::memory_order_relaxed)};
}

}  // namespace window_copy
}  // namespace comm
}  // namespace pycomm
