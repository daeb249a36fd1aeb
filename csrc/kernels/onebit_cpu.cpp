// 1-bit quantization with error feedback on the CPU (math in onebit.h).
// Two passes over each chunk: the sums of squares (float64), then signs,
// residuals and packed bits. AVX-512 (compare straight into a bit mask) and
// AVX2 (compare + movemask) variants picked at run time by cpu_isa(), a
// portable scalar fallback; threads split the buffer into ranges of whole
// 64-element blocks, so no two threads ever write the same byte.
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_dispatch.h"
#include "onebit.h"
#include "vec_x86.h"

namespace pycomm {
namespace kernels {
namespace {

// ---- portable ----
void sumsq_scalar(const float* x, const float* e, const uint8_t* m, size_t len, double* sum, size_t* cnt) {
  double a = 0;
  size_t k = 0;
  for (size_t i = 0; i < len; ++i) {
    if (m && !m[i]) continue;
    double c = static_cast<double>(x[i] + e[i]);
    a += c * c;
    ++k;
  }
  *sum = a;
  *cnt = k;
}

// `bits` points at the byte of element 0 (the segment starts on a byte boundary).
void quantize_scalar(const float* x, float* e, const uint8_t* m, size_t len, float s, uint8_t* bits) {
  for (size_t i0 = 0; i0 < len; i0 += 8) {
    size_t l = len - i0 < 8 ? len - i0 : 8;
    unsigned byte = 0;
    for (size_t k = 0; k < l; ++k) {
      size_t i = i0 + k;
      float c = x[i] + e[i];
      bool pos = c >= 0.0f;
      float q = pos ? s : -s;
      if (m && !m[i]) {
        e[i] = 0.0f;
        continue;
      }
      e[i] = c - q;
      byte |= unsigned(pos) << k;
    }
    bits[i0 / 8] = static_cast<uint8_t>(byte);
  }
}

void dequantize_scalar(const uint8_t* bits, const uint8_t* m, size_t len, float v, float* out, bool acc) {
  for (size_t i = 0; i < len; ++i) {
    float q = (bits[i / 8] >> (i % 8)) & 1u ? v : -v;
    if (m && !m[i]) q = 0.0f;
    if (acc) {
      if (!m || m[i]) out[i] += q;
    } else {
      out[i] = q;
    }
  }
}

#ifdef PYCOMM_X86
// ---- AVX2 ----
PYCOMM_TARGET_AVX2 void sumsq_avx2(const float* x, const float* e, const uint8_t* m, size_t len, double* sum,
                                   size_t* cnt) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  size_t k = 0, i = 0;
  const __m128i zero = _mm_setzero_si128();
  for (; i + 8 <= len; i += 8) {
    __m256 c = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(e + i));
    if (m) {
      __m128i out = _mm_cmpeq_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + i)), zero);
      c = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cvtepi8_epi32(out)), c);
      k += 8 - _mm_popcnt_u32(_mm_movemask_epi8(out) & 0xffu);
    }
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(c)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(c, 1));
    a0 = _mm256_fmadd_pd(lo, lo, a0);
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(a0, a1));
  double rest;
  size_t krest;
  sumsq_scalar(x + i, e + i, m ? m + i : nullptr, len - i, &rest, &krest);
  *sum = (t[0] + t[1]) + (t[2] + t[3]) + rest;
  *cnt = (m ? k : i) + krest;
}

PYCOMM_TARGET_AVX2 void quantize_avx2(const float* x, float* e, const uint8_t* m, size_t len, float s,
                                      uint8_t* bits) {
  const __m256 vs = _mm256_set1_ps(s), vns = _mm256_set1_ps(-s), zero = _mm256_setzero_ps();
  const __m128i zero8 = _mm_setzero_si128();
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 c = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(e + i));
    __m256 pos = _mm256_cmp_ps(c, zero, _CMP_GE_OQ);
    __m256 en = _mm256_sub_ps(c, _mm256_blendv_ps(vns, vs, pos));
    unsigned byte = static_cast<unsigned>(_mm256_movemask_ps(pos));
    if (m) {
      __m128i out = _mm_cmpeq_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + i)), zero8);
      en = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cvtepi8_epi32(out)), en);
      byte &= ~static_cast<unsigned>(_mm_movemask_epi8(out));
    }
    _mm256_storeu_ps(e + i, en);
    bits[i / 8] = static_cast<uint8_t>(byte);
  }
  if (i < len) quantize_scalar(x + i, e + i, m ? m + i : nullptr, len - i, s, bits + i / 8);
}

PYCOMM_TARGET_AVX2 void dequantize_avx2(const uint8_t* bits, const uint8_t* m, size_t len, float v, float* out,
                                        bool acc) {
  const __m256 vp = _mm256_set1_ps(v), vn = _mm256_set1_ps(-v);
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m128i zero8 = _mm_setzero_si128();
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits[i / 8]), lanes);
    __m256 pos = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lanes));
    __m256 q = _mm256_blendv_ps(vn, vp, pos);
    __m256 masked = _mm256_setzero_ps();  // lanes whose mask byte is 0
    if (m) {
      __m128i o = _mm_cmpeq_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + i)), zero8);
      masked = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(o));
    }
    if (acc) {
      __m256 old = _mm256_loadu_ps(out + i);
      q = _mm256_blendv_ps(_mm256_add_ps(old, q), old, masked);  // masked lanes keep their value
    } else {
      q = _mm256_andnot_ps(masked, q);  // +0 where masked
    }
    _mm256_storeu_ps(out + i, q);
  }
  if (i < len) dequantize_scalar(bits + i / 8, m ? m + i : nullptr, len - i, v, out + i, acc);
}

// ---- AVX-512 ----
PYCOMM_INL_AVX512 __mmask16 tail_mask(size_t left) {
  return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
}
PYCOMM_INL_AVX512 __mmask16 kept_mask(const uint8_t* m, __mmask16 k) {
  return _mm_mask_cmpneq_epi8_mask(k, _mm_maskz_loadu_epi8(k, m), _mm_setzero_si128());
}

PYCOMM_TARGET_AVX512 void sumsq_avx512(const float* x, const float* e, const uint8_t* m, size_t len, double* sum,
                                       size_t* cnt) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  size_t k = 0;
  for (size_t i = 0; i < len; i += 16) {
    __mmask16 t = tail_mask(len - i);
    __m512 c = _mm512_add_ps(_mm512_maskz_loadu_ps(t, x + i), _mm512_maskz_loadu_ps(t, e + i));
    if (m) {
      __mmask16 kept = kept_mask(m + i, t);
      c = _mm512_maskz_mov_ps(kept, c);
      k += _mm_popcnt_u32(kept);
    }
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(c)), hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(c, 1));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
    a1 = _mm512_fmadd_pd(hi, hi, a1);
  }
  *sum = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
  *cnt = m ? k : len;
}

PYCOMM_TARGET_AVX512 void quantize_avx512(const float* x, float* e, const uint8_t* m, size_t len, float s,
                                          uint8_t* bits) {
  const __m512 vs = _mm512_set1_ps(s), vns = _mm512_set1_ps(-s), zero = _mm512_setzero_ps();
  for (size_t i = 0; i < len; i += 16) {
    __mmask16 t = tail_mask(len - i);
    __m512 c = _mm512_add_ps(_mm512_maskz_loadu_ps(t, x + i), _mm512_maskz_loadu_ps(t, e + i));
    __mmask16 pos = _mm512_mask_cmp_ps_mask(t, c, zero, _CMP_GE_OQ);
    __m512 en = _mm512_sub_ps(c, _mm512_mask_blend_ps(pos, vns, vs));
    if (m) {
      __mmask16 kept = kept_mask(m + i, t);
      en = _mm512_maskz_mov_ps(kept, en);
      pos &= kept;
    }
    _mm512_mask_storeu_ps(e + i, t, en);
    uint16_t b = pos;
    if (t == 0xffff) std::memcpy(bits + i / 8, &b, 2);
    else {
      bits[i / 8] = static_cast<uint8_t>(b);
      if (len - i > 8) bits[i / 8 + 1] = static_cast<uint8_t>(b >> 8);
    }
  }
}

PYCOMM_TARGET_AVX512 void dequantize_avx512(const uint8_t* bits, const uint8_t* m, size_t len, float v, float* out,
                                            bool acc) {
  const __m512 vp = _mm512_set1_ps(v), vn = _mm512_set1_ps(-v);
  for (size_t i = 0; i < len; i += 16) {
    __mmask16 t = tail_mask(len - i);
    uint16_t b;
    if (t == 0xffff) std::memcpy(&b, bits + i / 8, 2);
    else b = len - i > 8 ? uint16_t(bits[i / 8] | (bits[i / 8 + 1] << 8)) : bits[i / 8];
    __m512 q = _mm512_mask_blend_ps(static_cast<__mmask16>(b), vn, vp);
    __mmask16 kept = m ? kept_mask(m + i, t) : t;
    if (acc) {
      _mm512_mask_storeu_ps(out + i, kept, _mm512_add_ps(_mm512_maskz_loadu_ps(kept, out + i), q));
    } else {
      _mm512_mask_storeu_ps(out + i, t, _mm512_maskz_mov_ps(kept, q));
    }
  }
}
#endif  // PYCOMM_X86

void sumsq_any(const float* x, const float* e, const uint8_t* m, size_t len, double* sum, size_t* cnt) {
#ifdef PYCOMM_X86
  switch (cpu_isa()) {
    case CpuIsa::Avx512: return sumsq_avx512(x, e, m, len, sum, cnt);
    case CpuIsa::Avx2: return sumsq_avx2(x, e, m, len, sum, cnt);
    default: break;
  }
#endif
  sumsq_scalar(x, e, m, len, sum, cnt);
}
void quantize_any(const float* x, float* e, const uint8_t* m, size_t len, float s, uint8_t* bits) {
#ifdef PYCOMM_X86
  switch (cpu_isa()) {
    case CpuIsa::Avx512: return quantize_avx512(x, e, m, len, s, bits);
    case CpuIsa::Avx2: return quantize_avx2(x, e, m, len, s, bits);
    default: break;
  }
#endif
  quantize_scalar(x, e, m, len, s, bits);
}
void dequantize_any(const uint8_t* bits, const uint8_t* m, size_t len, float v, float* out, bool acc) {
#ifdef PYCOMM_X86
  switch (cpu_isa()) {
    case CpuIsa::Avx512: return dequantize_avx512(bits, m, len, v, out, acc);
    case CpuIsa::Avx2: return dequantize_avx2(bits, m, len, v, out, acc);
    default: break;
  }
#endif
  dequantize_scalar(bits, m, len, v, out, acc);
}

// f(j, begin, end) for every chunk segment of [b, e).
template <class F>
void for_segments(size_t b, size_t e, size_t chunk, F&& f) {
  for (size_t j = b / chunk; j * chunk < e; ++j) {
    size_t sb = std::max(b, j * chunk), se = std::min(e, (j + 1) * chunk);
    f(j, sb, se);
  }
}

constexpr size_t kBlock = 64;  // thread ranges are whole blocks of 64 elements (8 bit-bytes)

void dequantize_all(const uint8_t* bits, const float* scales, size_t n, size_t chunk, float* out, float weight,
                    const uint8_t* mask, bool acc) {
  onebit_check_chunk(chunk);
  size_t traffic = n * (acc ? 8 : 4) + n / 8 + (mask ? n : 0);
  parallel_ranges(n, traffic, kBlock, [&](size_t b, size_t e) {
    for_segments(b, e, chunk, [&](size_t j, size_t sb, size_t se) {
      float v = acc ? weight * scales[j] : scales[j];
      dequantize_any(bits + sb / 8, mask ? mask + sb : nullptr, se - sb, v, out + sb, acc);
    });
  });
}

}  // namespace

void onebit_check_chunk(size_t chunk) {
  if (chunk == 0 || chunk % 8 != 0)
    throw std::invalid_argument("onebit: chunk must be a positive multiple of 8, got " + std::to_string(chunk));
}

void onebit_compress_cpu(const float* x, float* residual, size_t n, size_t chunk, uint8_t* bits, float* scales,
                         const uint8_t* mask) {
  onebit_check_chunk(chunk);
  if (n == 0) return;
  const size_t nc = onebit_num_chunks(n, chunk);
  std::vector<double> sums(nc, 0.0);
  std::vector<size_t> counts(nc, 0);
  const size_t traffic = n * 8 + (mask ? n : 0);
  // Pass 1: per-chunk sum of squares and kept count. A segment that is a
  // whole chunk belongs to one thread; split chunks are added atomically.
  parallel_ranges(n, traffic, kBlock, [&](size_t b, size_t e) {
    for_segments(b, e, chunk, [&](size_t j, size_t sb, size_t se) {
      double s;
      size_t k;
      sumsq_any(x + sb, residual + sb, mask ? mask + sb : nullptr, se - sb, &s, &k);
      bool whole = sb == j * chunk && se == std::min(n, (j + 1) * chunk);
      if (whole) {
        sums[j] = s;
        counts[j] = k;
      } else {
#pragma omp atomic
        sums[j] += s;
#pragma omp atomic
        counts[j] += k;
      }
    });
  });
  for (size_t j = 0; j < nc; ++j)
    scales[j] = counts[j] ? static_cast<float>(std::sqrt(sums[j] / static_cast<double>(counts[j]))) : 0.0f;
  // Pass 2: signs, residuals, bits.
  parallel_ranges(n, traffic + n * 4 + n / 8, kBlock, [&](size_t b, size_t e) {
    for_segments(b, e, chunk, [&](size_t j, size_t sb, size_t se) {
      quantize_any(x + sb, residual + sb, mask ? mask + sb : nullptr, se - sb, scales[j], bits + sb / 8);
    });
  });
}

void onebit_decompress_cpu(const uint8_t* bits, const float* scales, size_t n, size_t chunk, float* out,
                           const uint8_t* mask) {
  dequantize_all(bits, scales, n, chunk, out, 1.0f, mask, false);
}

void onebit_decompress_accumulate_cpu(const uint8_t* bits, const float* scales, size_t n, size_t chunk, float* out,
                                      float weight, const uint8_t* mask) {
  dequantize_all(bits, scales, n, chunk, out, weight, mask, true);
}

}  // namespace kernels
}  // namespace pycomm
