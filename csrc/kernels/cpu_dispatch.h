// Per-function ISA variants for the CPU kernels.
//
// PYCOMM_CPU_CLONES marks a hot loop to be compiled three times: for
// x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA + F16C) and the portable
// baseline. The dynamic loader picks the best one for the running CPU
// (ifunc), so installed builds never need -march=native. Elsewhere the macro
// is empty and the loop is compiled once for the target's baseline.
#pragma once
#include <cstddef>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(PYCOMM_NO_CLONES)
#define PYCOMM_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PYCOMM_CPU_CLONES
#endif

namespace pycomm {
namespace kernels {

// Loops shorter than this run on one thread: OpenMP fork/join costs a few
// microseconds, about the time to stream 64 KiB.
constexpr size_t kParallelMinBytes = size_t(1) << 20;

}  // namespace kernels
}  // namespace pycomm
