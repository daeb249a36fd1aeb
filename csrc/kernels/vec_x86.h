// Small x86 helpers for the hand-written CPU variants (internal header).
// Every function here is always_inline and carries its ISA's target
// attribute, so it may only be called from a function with the same target.
#pragma once
#include "cpu_dispatch.h"

#ifdef PYCOMM_X86
#include <immintrin.h>

// GCC 12 warns about the deliberately undefined vectors inside its own
// AVX-512 intrinsics (_mm512_undefined_*) once they are inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <cstdint>

#define PYCOMM_INL_AVX2 inline __attribute__((always_inline)) PYCOMM_TARGET_AVX2
#define PYCOMM_INL_AVX512 inline __attribute__((always_inline)) PYCOMM_TARGET_AVX512

namespace pycomm {
namespace kernels {
namespace x86 {

// ---- AVX2 + F16C, 8 lanes ----
PYCOMM_INL_AVX2 __m256 load_f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
PYCOMM_INL_AVX2 void store_f16x8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
PYCOMM_INL_AVX2 __m256 load_bf16x8(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// float -> bf16 bits in the low 16 bits of each 32-bit lane, round to nearest even, NaN kept quiet NaN.
PYCOMM_INL_AVX2 __m256i round_bf16x8(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, qnan, nan);
}
PYCOMM_INL_AVX2 void store_bf16x8(uint16_t* p, __m256 v) {
  __m256i r = round_bf16x8(v);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// ---- AVX-512, 16 lanes ----
PYCOMM_INL_AVX512 __m512 load_f16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
PYCOMM_INL_AVX512 __m256i cvt_f16x16(__m512 v) {
  return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
PYCOMM_INL_AVX512 __m512 load_bf16x16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
PYCOMM_INL_AVX512 __m512 maskz_load_bf16x16(__mmask16 k, const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
PYCOMM_INL_AVX512 __m256i cvt_bf16x16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  r = _mm512_mask_mov_epi32(r, nan, qnan);
  return _mm512_cvtepi32_epi16(r);
}

}  // namespace x86
}  // namespace kernels
}  // namespace pycomm
#endif  // PYCOMM_X86
