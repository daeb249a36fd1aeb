#include "reduce.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "cast.h"
#include "cpu_dispatch.h"
#include "half.h"
#include "vec_x86.h"

namespace pycomm {
namespace kernels {
namespace {

struct Sum { template <class T> static T apply(T a, T b) { return a + b; } };
struct Min { template <class T> static T apply(T a, T b) { return b < a ? b : a; } };
struct Max { template <class T> static T apply(T a, T b) { return b > a ? b : a; } };
struct Prod { template <class T> static T apply(T a, T b) { return a * b; } };

// NaN handling for min/max follows numpy's minimum/maximum: NaN wins.
struct MinNaN { template <class T> static T apply(T a, T b) { return (a != a || b != b) ? a + b : (b < a ? b : a); } };
struct MaxNaN { template <class T> static T apply(T a, T b) { return (a != a || b != b) ? a + b : (b > a ? b : a); } };

// bool (one byte, 0 or 1): Op on 0/1 then back to 0/1, so sum and max are a logical or,
// min and prod a logical and (docs/compatibility.md).
template <class Op>
struct Logical {
  static uint8_t apply(uint8_t a, uint8_t b) { return Op::apply(int(a != 0), int(b != 0)) != 0; }
};

template <class T, class Op>
PYCOMM_CPU_CLONES void reduce_native(T* __restrict dst, const T* __restrict src, size_t n) {
  simd_for(n, n * sizeof(T), [&](size_t i) { dst[i] = Op::apply(dst[i], src[i]); });
}

template <class Op>
PYCOMM_CPU_CLONES void reduce_f16(uint16_t* __restrict dst, const uint16_t* __restrict src, size_t n) {
  simd_for(n, n * 2, [&](size_t i) { dst[i] = float_to_half(Op::apply(half_to_float(dst[i]), half_to_float(src[i]))); });
}

template <class Op>
PYCOMM_CPU_CLONES void reduce_bf16(uint16_t* __restrict dst, const uint16_t* __restrict src, size_t n) {
  simd_for(n, n * 2, [&](size_t i) { dst[i] = float_to_bf16(Op::apply(bf16_to_float(dst[i]), bf16_to_float(src[i]))); });
}

#ifdef PYCOMM_X86
// Hand-written fp16/bf16 variants: F16C / shift widening, float math, one rounding.
// Min/max: the vector min/max, then NaN lanes replaced by a + b (NaN), as MinNaN/MaxNaN.
struct VSum {
  PYCOMM_INL_AVX512 static __m512 apply(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
  PYCOMM_INL_AVX2 static __m256 apply(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
};
struct VProd {
  PYCOMM_INL_AVX512 static __m512 apply(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
  PYCOMM_INL_AVX2 static __m256 apply(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
};
template <bool MIN>
struct VMinMax {
  PYCOMM_INL_AVX512 static __m512 apply(__m512 a, __m512 b) {
    __m512 r = MIN ? _mm512_min_ps(b, a) : _mm512_max_ps(b, a);  // b < a ? b : a, like Min (signed zeros too)
    return _mm512_mask_add_ps(r, _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q), a, b);
  }
  PYCOMM_INL_AVX2 static __m256 apply(__m256 a, __m256 b) {
    __m256 r = MIN ? _mm256_min_ps(b, a) : _mm256_max_ps(b, a);
    return _mm256_blendv_ps(r, _mm256_add_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
};

template <class V, bool BF16>
PYCOMM_TARGET_AVX512 void reduce_half_avx512(uint16_t* __restrict dst, const uint16_t* __restrict src, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    __m512 a, b;
    if (BF16) {
      a = x86::maskz_load_bf16x16(k, dst + i);
      b = x86::maskz_load_bf16x16(k, src + i);
    } else {
      a = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, dst + i));
      b = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, src + i));
    }
    __m512 r = V::apply(a, b);
    _mm256_mask_storeu_epi16(dst + i, k, BF16 ? x86::cvt_bf16x16(r) : x86::cvt_f16x16(r));
  }
}

template <class V, class OpF, bool BF16>
PYCOMM_TARGET_AVX2 void reduce_half_avx2(uint16_t* __restrict dst, const uint16_t* __restrict src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = BF16 ? x86::load_bf16x8(dst + i) : x86::load_f16x8(dst + i);
    __m256 b = BF16 ? x86::load_bf16x8(src + i) : x86::load_f16x8(src + i);
    __m256 r = V::apply(a, b);
    if (BF16) x86::store_bf16x8(dst + i, r);
    else x86::store_f16x8(dst + i, r);
  }
  for (; i < n; ++i)
    dst[i] = BF16 ? float_to_bf16(OpF::apply(bf16_to_float(dst[i]), bf16_to_float(src[i])))
                  : float_to_half(OpF::apply(half_to_float(dst[i]), half_to_float(src[i])));
}

template <class OpF> struct VecOf;
template <> struct VecOf<Sum> { using type = VSum; };
template <> struct VecOf<MinNaN> { using type = VMinMax<true>; };
template <> struct VecOf<MaxNaN> { using type = VMinMax<false>; };
template <> struct VecOf<Prod> { using type = VProd; };
#endif  // PYCOMM_X86

// fp16/bf16: the hand-written variant chosen by cpu_isa(), threads over ranges.
template <class OpF, bool BF16>
void reduce_half(uint16_t* dst, const uint16_t* src, size_t n) {
#ifdef PYCOMM_X86
  const CpuIsa isa = cpu_isa();
  if (isa != CpuIsa::Scalar) {
    using V = typename VecOf<OpF>::type;
    parallel_ranges(n, n * 6, 64, [&](size_t b, size_t e) {
      if (isa == CpuIsa::Avx512) reduce_half_avx512<V, BF16>(dst + b, src + b, e - b);
      else reduce_half_avx2<V, OpF, BF16>(dst + b, src + b, e - b);
    });
    return;
  }
#endif
  if (BF16) reduce_bf16<OpF>(dst, src, n);
  else reduce_f16<OpF>(dst, src, n);
}

template <class Op, class OpF>
void reduce_typed(void* dst, const void* src, size_t n, DType dtype) {
  switch (dtype) {
    case DType::F32: return reduce_native<float, OpF>(static_cast<float*>(dst), static_cast<const float*>(src), n);
    case DType::F64: return reduce_native<double, OpF>(static_cast<double*>(dst), static_cast<const double*>(src), n);
    case DType::I32: return reduce_native<int32_t, Op>(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n);
    case DType::I64: return reduce_native<int64_t, Op>(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n);
    case DType::F16: return reduce_half<OpF, false>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n);
    case DType::BF16: return reduce_half<OpF, true>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n);
    // Narrow integers wrap around like int32/int64 (the build uses -fwrapv; the
    // narrowing conversion back to T is modular since C++20 and in GCC/Clang before).
    case DType::U8: return reduce_native<uint8_t, Op>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
    case DType::I8: return reduce_native<int8_t, Op>(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), n);
    case DType::I16: return reduce_native<int16_t, Op>(static_cast<int16_t*>(dst), static_cast<const int16_t*>(src), n);
    case DType::BOOL:
      return reduce_native<uint8_t, Logical<Op>>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
  }
  throw std::invalid_argument("reduce_cpu: unsupported dtype");
}

template <class T>
PYCOMM_CPU_CLONES void scale_native(T* __restrict dst, size_t n, T f) {
  simd_for(n, n * sizeof(T), [&](size_t i) { dst[i] *= f; });
}

}  // namespace

void reduce_cpu(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  switch (op) {
    case ReduceOp::SUM: return reduce_typed<Sum, Sum>(dst, src, count, dtype);
    case ReduceOp::MIN: return reduce_typed<Min, MinNaN>(dst, src, count, dtype);
    case ReduceOp::MAX: return reduce_typed<Max, MaxNaN>(dst, src, count, dtype);
    case ReduceOp::PROD: return reduce_typed<Prod, Prod>(dst, src, count, dtype);
  }
  throw std::invalid_argument("reduce_cpu: unsupported op");
}

void scale_cpu(void* dst, size_t count, DType dtype, double factor) {
  if (count == 0) return;
  switch (dtype) {
    case DType::F32: return scale_native<float>(static_cast<float*>(dst), count, static_cast<float>(factor));
    case DType::F64: return scale_native<double>(static_cast<double*>(dst), count, factor);
    case DType::F16:
    case DType::BF16: return scale_half_cpu(dst, dst, count, dtype, static_cast<float>(factor));
    default: throw std::invalid_argument("scale_cpu: integer tensors cannot be scaled");
  }
}

}  // namespace kernels
}  // namespace pycomm
