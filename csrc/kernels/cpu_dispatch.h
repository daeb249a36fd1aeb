// CPU dispatch: per-function ISA variants and the OpenMP thread policy.
//
// Two mechanisms, both free of -march=native:
//  * PYCOMM_CPU_CLONES marks a plain loop to be compiled three times, for
//    x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA + F16C) and the portable
//    baseline; the dynamic loader picks one for the running CPU (ifunc).
//    Used where the compiler vectorizes the loop well by itself.
//  * Hand-written variants (F16C conversions, sign-bit packing) are compiled
//    with PYCOMM_TARGET_AVX2 / PYCOMM_TARGET_AVX512 and chosen at run time by
//    cpu_isa(): the best the CPU supports, lowered by PYCOMM_CPU_ISA=
//    scalar|avx2|avx512 in the environment or by set_cpu_isa() (tests use it
//    to exercise every variant on one machine).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(PYCOMM_NO_CLONES)
#define PYCOMM_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PYCOMM_CPU_CLONES
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define PYCOMM_X86 1
#define PYCOMM_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2,popcnt")))
#define PYCOMM_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,popcnt")))
#endif

namespace pycomm {
namespace kernels {

// Loops shorter than this run on one thread: OpenMP fork/join costs a few
// microseconds, about the time to stream 64 KiB.
constexpr size_t kParallelMinBytes = size_t(1) << 20;

enum class CpuIsa : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

inline const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx512: return "avx512";
    case CpuIsa::Avx2: return "avx2";
    default: return "scalar";
  }
}

// The best variant this CPU runs.
inline CpuIsa cpu_isa_supported() {
#ifdef PYCOMM_X86
  static const CpuIsa best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("bmi2"))
      return CpuIsa::Avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("bmi2"))
      return CpuIsa::Avx2;
    return CpuIsa::Scalar;
  }();
  return best;
#else
  return CpuIsa::Scalar;
#endif
}

namespace detail {
inline int initial_isa() {
  int best = static_cast<int>(cpu_isa_supported());
  if (const char* env = std::getenv("PYCOMM_CPU_ISA")) {
    int want = best;
    if (!std::strcmp(env, "scalar")) want = 0;
    else if (!std::strcmp(env, "avx2")) want = 1;
    else if (!std::strcmp(env, "avx512")) want = 2;
    return std::min(want, best);
  }
  return best;
}
inline std::atomic<int>& isa_slot() {
  static std::atomic<int> slot{initial_isa()};
  return slot;
}
inline std::atomic<int>& threads_slot() {
  static std::atomic<int> slot{0};
  return slot;
}
}  // namespace detail

// The variant the hand-written kernels use now.
inline CpuIsa cpu_isa() { return static_cast<CpuIsa>(detail::isa_slot().load(std::memory_order_relaxed)); }

// Choose a variant; one the CPU lacks is lowered to the best it has. Returns the one in use.
inline CpuIsa set_cpu_isa(CpuIsa isa) {
  int v = std::min(static_cast<int>(isa), static_cast<int>(cpu_isa_supported()));
  detail::isa_slot().store(std::max(v, 0));
  return cpu_isa();
}

// OpenMP threads the kernels use above kParallelMinBytes; 0 (the default)
// means OpenMP's own choice (OMP_NUM_THREADS or the core count).
inline void set_cpu_threads(int n) { detail::threads_slot().store(n < 0 ? 0 : n); }
inline int cpu_threads() {
  int n = detail::threads_slot().load(std::memory_order_relaxed);
#ifdef _OPENMP
  return n > 0 ? n : omp_get_max_threads();
#else
  (void)n;
  return 1;
#endif
}

// Threads for a loop that touches `bytes` bytes: 1 below the threshold.
inline int threads_for(size_t bytes) { return bytes >= kParallelMinBytes ? std::max(1, cpu_threads()) : 1; }

// body(i) for i in [0, n), vectorized, on threads_for(bytes) threads. Not one
// `omp parallel for simd ... if (bytes >= kParallelMinBytes)`: GCC runs that
// construct's serial fallback unvectorized, and a float32 sum below 1 MiB ran
// at 14 GB/s against 52 GB/s just above it (a 512 KiB slice of the shm
// pipeline, every ring chunk). Call it from a PYCOMM_CPU_CLONES function: it is
// inlined into each clone and vectorized for its instruction set.
template <class Body>
inline __attribute__((always_inline)) void simd_for(size_t n, size_t bytes, Body&& body) {
  if (bytes < kParallelMinBytes) {
#pragma omp simd
    for (size_t i = 0; i < n; ++i) body(i);
    return;
  }
#pragma omp parallel for simd schedule(static) num_threads(threads_for(bytes))
  for (size_t i = 0; i < n; ++i) body(i);
}

// Run f(begin, end) over [0, n) split into one contiguous range per thread;
// range boundaries are multiples of `align` elements (except n itself).
template <class F>
void parallel_ranges(size_t n, size_t bytes, size_t align, F&& f) {
  int nt = threads_for(bytes);
  if (nt <= 1 || n <= align) {
    if (n) f(size_t(0), n);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
  {
    size_t t = static_cast<size_t>(omp_get_thread_num()), T = static_cast<size_t>(omp_get_num_threads());
    size_t per = (n + T - 1) / T;
    per = (per + align - 1) / align * align;
    size_t b = std::min(n, t * per), e = std::min(n, b + per);
    if (b < e) f(b, e);
  }
#else
  f(size_t(0), n);
#endif
}

}  // namespace kernels
}  // namespace pycomm
