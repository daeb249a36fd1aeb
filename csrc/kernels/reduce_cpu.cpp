#include "reduce.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "cpu_dispatch.h"
#include "half.h"

namespace pycomm {
namespace kernels {
namespace {

struct Sum { template <class T> static T apply(T a, T b) { return a + b; } };
struct Min { template <class T> static T apply(T a, T b) { return b < a ? b : a; } };
struct Max { template <class T> static T apply(T a, T b) { return b > a ? b : a; } };

// NaN handling for min/max follows numpy's minimum/maximum: NaN wins.
struct MinNaN { template <class T> static T apply(T a, T b) { return (a != a || b != b) ? a + b : (b < a ? b : a); } };
struct MaxNaN { template <class T> static T apply(T a, T b) { return (a != a || b != b) ? a + b : (b > a ? b : a); } };

template <class T, class Op>
PYCOMM_CPU_CLONES void reduce_native(T* __restrict dst, const T* __restrict src, size_t n) {
#pragma omp parallel for simd schedule(static) num_threads(threads_for(n * sizeof(T))) if (n * sizeof(T) >= kParallelMinBytes)
  for (size_t i = 0; i < n; ++i) dst[i] = Op::apply(dst[i], src[i]);
}

template <class Op>
PYCOMM_CPU_CLONES void reduce_f16(uint16_t* __restrict dst, const uint16_t* __restrict src, size_t n) {
#pragma omp parallel for simd schedule(static) num_threads(threads_for(n * 2)) if (n * 2 >= kParallelMinBytes)
  for (size_t i = 0; i < n; ++i)
    dst[i] = float_to_half(Op::apply(half_to_float(dst[i]), half_to_float(src[i])));
}

template <class Op>
PYCOMM_CPU_CLONES void reduce_bf16(uint16_t* __restrict dst, const uint16_t* __restrict src, size_t n) {
#pragma omp parallel for simd schedule(static) num_threads(threads_for(n * 2)) if (n * 2 >= kParallelMinBytes)
  for (size_t i = 0; i < n; ++i)
    dst[i] = float_to_bf16(Op::apply(bf16_to_float(dst[i]), bf16_to_float(src[i])));
}

template <class Op, class OpF>
void reduce_typed(void* dst, const void* src, size_t n, DType dtype) {
  switch (dtype) {
    case DType::F32: return reduce_native<float, OpF>(static_cast<float*>(dst), static_cast<const float*>(src), n);
    case DType::F64: return reduce_native<double, OpF>(static_cast<double*>(dst), static_cast<const double*>(src), n);
    case DType::I32: return reduce_native<int32_t, Op>(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n);
    case DType::I64: return reduce_native<int64_t, Op>(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n);
    case DType::F16: return reduce_f16<OpF>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n);
    case DType::BF16: return reduce_bf16<OpF>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n);
  }
  throw std::invalid_argument("reduce_cpu: unsupported dtype");
}

template <class T>
PYCOMM_CPU_CLONES void scale_native(T* __restrict dst, size_t n, T f) {
#pragma omp parallel for simd schedule(static) num_threads(threads_for(n * sizeof(T))) if (n * sizeof(T) >= kParallelMinBytes)
  for (size_t i = 0; i < n; ++i) dst[i] *= f;
}

PYCOMM_CPU_CLONES void scale_f16(uint16_t* __restrict dst, size_t n, float f) {
#pragma omp parallel for simd schedule(static) num_threads(threads_for(n * 2)) if (n * 2 >= kParallelMinBytes)
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_half(half_to_float(dst[i]) * f);
}

PYCOMM_CPU_CLONES void scale_bf16(uint16_t* __restrict dst, size_t n, float f) {
#pragma omp parallel for simd schedule(static) num_threads(threads_for(n * 2)) if (n * 2 >= kParallelMinBytes)
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_bf16(bf16_to_float(dst[i]) * f);
}

}  // namespace

void reduce_cpu(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  switch (op) {
    case ReduceOp::SUM: return reduce_typed<Sum, Sum>(dst, src, count, dtype);
    case ReduceOp::MIN: return reduce_typed<Min, MinNaN>(dst, src, count, dtype);
    case ReduceOp::MAX: return reduce_typed<Max, MaxNaN>(dst, src, count, dtype);
  }
  throw std::invalid_argument("reduce_cpu: unsupported op");
}

void scale_cpu(void* dst, size_t count, DType dtype, double factor) {
  if (count == 0) return;
  switch (dtype) {
    case DType::F32: return scale_native<float>(static_cast<float*>(dst), count, static_cast<float>(factor));
    case DType::F64: return scale_native<double>(static_cast<double*>(dst), count, factor);
    case DType::F16: return scale_f16(static_cast<uint16_t*>(dst), count, static_cast<float>(factor));
    case DType::BF16: return scale_bf16(static_cast<uint16_t*>(dst), count, static_cast<float>(factor));
    default: throw std::invalid_argument("scale_cpu: integer tensors cannot be scaled");
  }
}

}  // namespace kernels
}  // namespace pycomm
