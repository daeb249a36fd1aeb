// Copies into the shared window (shm_window.h), with ordinary or streaming stores.
//
// A rank writes its window segment in every call, and its peers read it in every call, so the
// lines it writes are usually in another core's cache. An ordinary store must invalidate each
// such line there before it lands. How long that takes depends on where the two cores are: on the
// 2-core virtual machine of docs/benchmarks.md ("shm's own slice in place", "Streaming stores into
// the window") it switched within minutes between about 55 and 440 us per MiB copied, against 21 us
// for a segment no other process reads. Streaming stores (kernels/stream_copy.h) skip the read for
// ownership, but leave the lines in no cache, so the peers then read them from memory: a whole
// 1 MiB shm allreduce on 2 ranks took 56-59 us with ordinary stores and 127-138 us with streaming
// ones in the fast state, 482-531 against 87-91 in the slow one.
//
// So the choice is measured, per engine thread and per size class of message: a WindowCall times
// the whole call (copies, reduction and fences, so the peers' slower reads count too), and AUTO
// keeps whichever method has the lower recent time per byte, trying the other one after 4 calls,
// then after twice as many each time it loses, up to 1024. The ranks run the same sequence of
// calls, so they mostly try on the same calls (not always: a blocking call on an idle engine runs on
// the caller's thread, whose state is its own). The bytes are the same either way: ranks need not agree.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "../kernels/dtype.h"

namespace pycomm {
namespace comm {
namespace window_copy {

enum class Stores { AUTO, CACHED, STREAMING };

// Process-wide: AUTO (the default), or one method always (benchmarks and tests).
void set_stores(Stores stores);
Stores stores();
Stores parse_stores(const std::string& name);  // "auto" | "cached" | "streaming"; else CommError

// Process-wide totals since the start: bytes copied each way, and AUTO's changes of method.
struct Totals {
  uint64_t cached_bytes = 0, streamed_bytes = 0, switches = 0;
};
Totals totals();

// One shm allreduce of `message_bytes`: picks the method when made, copies with it, and when it
// ends normally (finish()) records the call's time for AUTO's choice.
class WindowCall {
 public:
  explicit WindowCall(size_t message_bytes);
  WindowCall(const WindowCall&) = delete;
  WindowCall& operator=(const WindowCall&) = delete;

  void copy(void* dst, const void* src, size_t bytes) const;  // into window memory `dst`
  // Tensors `srcs` (counts[k] elements of `dtype` each) back to back into window memory `dst`;
  // ordinary stores go through the fusion kernel (kernels/fusion.h), which splits large packs over threads.
  void pack(const void* const* srcs, const size_t* counts, size_t num, char* dst, kernels::DType dtype) const;
  void finish();

 private:
  size_t bytes_;
  bool streaming_ = false, measured_ = false;
  std::chrono::steady_clock::time_point began_;
};

}  // namespace window_copy
}  // namespace comm
}  // namespace pycomm
