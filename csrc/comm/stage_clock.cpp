#include "stage_clock.h"

namespace pycomm {
namespace comm {
namespace stage_clock {

std::atomic<bool> g_running{false};

namespace {
std::array<std::atomic<uint64_t>, kStageCount> g_nanoseconds{}, g_bytes{}, g_marks{};
}

const char* stage_name(Stage s) {
  static const char* const names[kStageCount] = {"copy_in", "reduce", "copy_out", "barrier", "mpi"};
  return names[s];
}

void set_running(bool on) { g_running.store(on, std::memory_order_relaxed); }

void add(Stage s, uint64_t nanoseconds, uint64_t bytes) {
  g_nanoseconds[s].fetch_add(nanoseconds, std::memory_order_relaxed);
  g_bytes[s].fetch_add(bytes, std::memory_order_relaxed);
  g_marks[s].fetch_add(1, std::memory_order_relaxed);
}

StageTotals take() {
  StageTotals t;
  for (int s = 0; s < kStageCount; ++s) {
    t.nanoseconds[s] = g_nanoseconds[s].exchange(0, std::memory_order_relaxed);
    t.bytes[s] = g_bytes[s].exchange(0, std::memory_order_relaxed);
    t.marks[s] = g_marks[s].exchange(0, std::memory_order_relaxed);
  }
  return t;
}

}  // namespace stage_clock
}  // namespace comm
}  // namespace pycomm
