// FP16/BF16 casts on the CPU: AVX-512 and AVX2+F16C variants picked at run
// time (cpu_isa()), a portable scalar fallback, OpenMP above kParallelMinBytes.
#include <atomic>
#include <cstdint>
#include <stdexcept>

#include "cast.h"
#include "cpu_dispatch.h"
#include "half.h"
#include "vec_x86.h"

namespace pycomm {
namespace kernels {
namespace {

constexpr uint16_t kF16Inf = 0x7c00, kBF16Inf = 0x7f80;

// ---- portable ----
template <bool BF16>
int to_half_scalar(const float* __restrict x, uint16_t* __restrict y, size_t n, float s) {
  uint16_t worst = 0;
  for (size_t i = 0; i < n; ++i) {
    float v = x[i] * s;
    uint16_t h = BF16 ? float_to_bf16(v) : float_to_half(v);
    y[i] = h;
    uint16_t a = h & 0x7fffu;
    worst = a > worst ? a : worst;
  }
  return worst >= (BF16 ? kBF16Inf : kF16Inf);
}
template <bool BF16>
void to_float_scalar(const uint16_t* __restrict x, float* __restrict y, size_t n, float s) {
  for (size_t i = 0; i < n; ++i) y[i] = (BF16 ? bf16_to_float(x[i]) : half_to_float(x[i])) * s;
}
template <bool BF16>
void scale_half_scalar(const uint16_t* x, uint16_t* y, size_t n, float s) {
  for (size_t i = 0; i < n; ++i)
    y[i] = BF16 ? float_to_bf16(bf16_to_float(x[i]) * s) : float_to_half(half_to_float(x[i]) * s);
}
template <bool BF16>
void accumulate_scalar(float* __restrict acc, const uint16_t* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += BF16 ? bf16_to_float(x[i]) : half_to_float(x[i]);
}

#ifdef PYCOMM_X86
using namespace x86;

// ---- AVX2 + F16C ----
template <bool BF16>
PYCOMM_TARGET_AVX2 int to_half_avx2(const float* __restrict x, uint16_t* __restrict y, size_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  __m128i worst = _mm_setzero_si128();
  const __m128i abs = _mm_set1_epi16(0x7fff);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vs);
    __m128i h;
    if (BF16) {
      __m256i r = round_bf16x8(v);
      h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    } else {
      h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), h);
    worst = _mm_max_epu16(worst, _mm_and_si128(h, abs));
  }
  alignas(16) uint16_t w[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(w), worst);
  int bad = to_half_scalar<BF16>(x + i, y + i, n - i, s);
  for (uint16_t v : w) bad |= v >= (BF16 ? kBF16Inf : kF16Inf);
  return bad;
}
template <bool BF16>
PYCOMM_TARGET_AVX2 void to_float_avx2(const uint16_t* __restrict x, float* __restrict y, size_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = BF16 ? load_bf16x8(x + i) : load_f16x8(x + i);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(v, vs));
  }
  to_float_scalar<BF16>(x + i, y + i, n - i, s);
}
template <bool BF16>
PYCOMM_TARGET_AVX2 void accumulate_avx2(float* __restrict acc, const uint16_t* __restrict x, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = BF16 ? load_bf16x8(x + i) : load_f16x8(x + i);
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), v));
  }
  accumulate_scalar<BF16>(acc + i, x + i, n - i);
}

template <bool BF16>
PYCOMM_TARGET_AVX2 void scale_half_avx2(const uint16_t* x, uint16_t* y, size_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(BF16 ? load_bf16x8(x + i) : load_f16x8(x + i), vs);
    if (BF16) store_bf16x8(y + i, v);
    else store_f16x8(y + i, v);
  }
  scale_half_scalar<BF16>(x + i, y + i, n - i, s);
}

// ---- AVX-512 (masked tails, no scalar loop) ----
template <bool BF16>
PYCOMM_TARGET_AVX512 int to_half_avx512(const float* __restrict x, uint16_t* __restrict y, size_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  __m256i worst = _mm256_setzero_si256();
  const __m256i abs = _mm256_set1_epi16(0x7fff);
  for (size_t i = 0; i < n; i += 16) {
    __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), vs);
    __m256i h = BF16 ? cvt_bf16x16(v) : cvt_f16x16(v);
    _mm256_mask_storeu_epi16(y + i, k, h);
    worst = _mm256_max_epu16(worst, _mm256_and_si256(h, abs));  // masked-off lanes are 0
  }
  __mmask16 bad = _mm256_cmpge_epu16_mask(worst, _mm256_set1_epi16(BF16 ? kBF16Inf : kF16Inf));
  return bad != 0;
}
template <bool BF16>
PYCOMM_TARGET_AVX512 void to_float_avx512(const uint16_t* __restrict x, float* __restrict y, size_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  for (size_t i = 0; i < n; i += 16) {
    __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    __m512 v = BF16 ? maskz_load_bf16x16(k, x + i) : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, x + i));
    _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(v, vs));
  }
}
template <bool BF16>
PYCOMM_TARGET_AVX512 void accumulate_avx512(float* __restrict acc, const uint16_t* __restrict x, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    __m512 v = BF16 ? maskz_load_bf16x16(k, x + i) : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, x + i));
    _mm512_mask_storeu_ps(acc + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, acc + i), v));
  }
}
template <bool BF16>
PYCOMM_TARGET_AVX512 void scale_half_avx512(const uint16_t* x, uint16_t* y, size_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  for (size_t i = 0; i < n; i += 16) {
    __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    __m512 v = BF16 ? maskz_load_bf16x16(k, x + i) : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, x + i));
    v = _mm512_mul_ps(v, vs);
    _mm256_mask_storeu_epi16(y + i, k, BF16 ? cvt_bf16x16(v) : cvt_f16x16(v));
  }
}
#endif  // PYCOMM_X86

template <bool BF16>
void scale_half_any(const uint16_t* x, uint16_t* y, size_t n, float s) {
#ifdef PYCOMM_X86
  switch (cpu_isa()) {
    case CpuIsa::Avx512: return scale_half_avx512<BF16>(x, y, n, s);
    case CpuIsa::Avx2: return scale_half_avx2<BF16>(x, y, n, s);
    default: break;
  }
#endif
  scale_half_scalar<BF16>(x, y, n, s);
}

template <bool BF16>
int to_half_any(const float* x, uint16_t* y, size_t n, float s) {
#ifdef PYCOMM_X86
  switch (cpu_isa()) {
    case CpuIsa::Avx512: return to_half_avx512<BF16>(x, y, n, s);
    case CpuIsa::Avx2: return to_half_avx2<BF16>(x, y, n, s);
    default: break;
  }
#endif
  return to_half_scalar<BF16>(x, y, n, s);
}
template <bool BF16>
void to_float_any(const uint16_t* x, float* y, size_t n, float s) {
#ifdef PYCOMM_X86
  switch (cpu_isa()) {
    case CpuIsa::Avx512: return to_float_avx512<BF16>(x, y, n, s);
    case CpuIsa::Avx2: return to_float_avx2<BF16>(x, y, n, s);
    default: break;
  }
#endif
  to_float_scalar<BF16>(x, y, n, s);
}
template <bool BF16>
void accumulate_any(float* acc, const uint16_t* x, size_t n) {
#ifdef PYCOMM_X86
  switch (cpu_isa()) {
    case CpuIsa::Avx512: return accumulate_avx512<BF16>(acc, x, n);
    case CpuIsa::Avx2: return accumulate_avx2<BF16>(acc, x, n);
    default: break;
  }
#endif
  accumulate_scalar<BF16>(acc, x, n);
}

void check_half(DType t, const char* what) {
  if (t != DType::F16 && t != DType::BF16)
    throw std::invalid_argument(std::string(what) + ": the half type must be float16 or bfloat16, got " +
                                dtype_name(t));
}

}  // namespace

void cast_to_half_cpu(const float* x, void* y, size_t n, DType half, float scale, int* nonfinite) {
  check_half(half, "cast_to_half_cpu");
  std::atomic<int> bad{0};
  auto* out = static_cast<uint16_t*>(y);
  parallel_ranges(n, n * 6, 64, [&](size_t b, size_t e) {
    int r = half == DType::BF16 ? to_half_any<true>(x + b, out + b, e - b, scale)
                                : to_half_any<false>(x + b, out + b, e - b, scale);
    if (r) bad.store(1, std::memory_order_relaxed);
  });
  if (nonfinite) *nonfinite = bad.load();
}

void cast_to_float_cpu(const void* x, float* y, size_t n, DType half, float scale) {
  check_half(half, "cast_to_float_cpu");
  const auto* in = static_cast<const uint16_t*>(x);
  parallel_ranges(n, n * 6, 64, [&](size_t b, size_t e) {
    if (half == DType::BF16) to_float_any<true>(in + b, y + b, e - b, scale);
    else to_float_any<false>(in + b, y + b, e - b, scale);
  });
}

void scale_half_cpu(const void* x, void* y, size_t n, DType half, float scale) {
  check_half(half, "scale_half_cpu");
  const auto* in = static_cast<const uint16_t*>(x);
  auto* out = static_cast<uint16_t*>(y);
  parallel_ranges(n, n * 4, 64, [&](size_t b, size_t e) {
    if (half == DType::BF16) scale_half_any<true>(in + b, out + b, e - b, scale);
    else scale_half_any<false>(in + b, out + b, e - b, scale);
  });
}

void accumulate_half_cpu(float* acc, const void* x, size_t n, DType half) {
  check_half(half, "accumulate_half_cpu");
  const auto* in = static_cast<const uint16_t*>(x);
  parallel_ranges(n, n * 10, 64, [&](size_t b, size_t e) {
    if (half == DType::BF16) accumulate_any<true>(acc + b, in + b, e - b);
    else accumulate_any<false>(acc + b, in + b, e - b);
  });
}

}  // namespace kernels
}  // namespace pycomm
