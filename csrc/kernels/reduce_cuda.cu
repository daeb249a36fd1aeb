// dst = dst op src and dst *= factor on the GPU (same semantics as reduce_cpu):
// grid-stride loops over 16-byte packs when both pointers are 16-byte aligned,
// element by element otherwise; fp16/bf16 combined in fp32 and rounded once;
// min/max propagate NaN.
#include <type_traits>

#include "cuda_check.h"
#include "reduce.h"

namespace pycomm {
namespace kernels {
namespace {

using cuda::Pack;

// Storage type S, compute type C.
template <class S> struct Native {
  using Storage = S;
  __device__ static S load(S v) { return v; }
  __device__ static S store(S v) { return v; }
};
struct F16 {
  using Storage = uint16_t;
  __device__ static float load(uint16_t v) { return cuda::f16_to_float(v); }
  __device__ static uint16_t store(float v) { return cuda::float_to_f16(v); }
};
struct BF16 {
  using Storage = uint16_t;
  __device__ static float load(uint16_t v) { return cuda::bf16_to_float(v); }
  __device__ static uint16_t store(float v) { return cuda::float_to_bf16(v); }
};

// bool: loaded as 0/1, stored as (v != 0): sum and max give or, min and prod give and.
struct Bool {
  using Storage = uint8_t;
  __device__ static int load(uint8_t v) { return v != 0; }
  __device__ static uint8_t store(int v) { return v != 0; }
};

struct Sum { template <class T> __device__ static T apply(T a, T b) { return a + b; } };
struct Prod { template <class T> __device__ static T apply(T a, T b) { return a * b; } };
struct Min {
  template <class T> __device__ static T apply(T a, T b) {
    if constexpr (std::is_floating_point<T>::value) {
      if (a != a || b != b) return a + b;
    }
    return b < a ? b : a;
  }
};
struct Max {
  template <class T> __device__ static T apply(T a, T b) {
    if constexpr (std::is_floating_point<T>::value) {
      if (a != a || b != b) return a + b;
    }
    return b > a ? b : a;
  }
};

template <class E, class Op>
__global__ void reduce_kernel(typename E::Storage* __restrict__ dst, const typename E::Storage* __restrict__ src,
                              size_t n, bool vec) {
  using S = typename E::Storage;
  const size_t tid = blockIdx.x * size_t(blockDim.x) + threadIdx.x, stride = size_t(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (vec) {
    const size_t nv = n / Pack<S>::N;
    auto* d = reinterpret_cast<Pack<S>*>(dst);
    const auto* s = reinterpret_cast<const Pack<S>*>(src);
    for (size_t i = tid; i < nv; i += stride) {
      Pack<S> a = d[i], b = s[i];
#pragma unroll
      for (int k = 0; k < Pack<S>::N; ++k) a.v[k] = E::store(Op::apply(E::load(a.v[k]), E::load(b.v[k])));
      d[i] = a;
    }
    done = nv * Pack<S>::N;
  }
  for (size_t i = done + tid; i < n; i += stride) dst[i] = E::store(Op::apply(E::load(dst[i]), E::load(src[i])));
}

template <class E, class F>
__global__ void scale_kernel(typename E::Storage* __restrict__ p, size_t n, F f, bool vec) {
  using S = typename E::Storage;
  const size_t tid = blockIdx.x * size_t(blockDim.x) + threadIdx.x, stride = size_t(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (vec) {
    const size_t nv = n / Pack<S>::N;
    auto* d = reinterpret_cast<Pack<S>*>(p);
    for (size_t i = tid; i < nv; i += stride) {
      Pack<S> a = d[i];
#pragma unroll
      for (int k = 0; k < Pack<S>::N; ++k) a.v[k] = E::store(E::load(a.v[k]) * f);
      d[i] = a;
    }
    done = nv * Pack<S>::N;
  }
  for (size_t i = done + tid; i < n; i += stride) p[i] = E::store(E::load(p[i]) * f);
}

template <class E, class Op>
void launch_reduce(void* dst, const void* src, size_t n, Stream stream) {
  using S = typename E::Storage;
  bool vec = cuda::aligned16(dst) && cuda::aligned16(src);
  unsigned blocks = cuda::blocks_for(vec ? n / Pack<S>::N + 1 : n);
  reduce_kernel<E, Op><<<blocks, cuda::kThreads, 0, stream>>>(static_cast<S*>(dst), static_cast<const S*>(src), n,
                                                                vec);
  PYCOMM_CUDA_CHECK_LAUNCH();
}

template <class Op>
void reduce_typed(void* dst, const void* src, size_t n, DType dtype, Stream stream) {
  switch (dtype) {
    case DType::F32: return launch_reduce<Native<float>, Op>(dst, src, n, stream);
    case DType::F64: return launch_reduce<Native<double>, Op>(dst, src, n, stream);
    case DType::I32: return launch_reduce<Native<int32_t>, Op>(dst, src, n, stream);
    case DType::I64: return launch_reduce<Native<int64_t>, Op>(dst, src, n, stream);
    case DType::F16: return launch_reduce<F16, Op>(dst, src, n, stream);
    case DType::BF16: return launch_reduce<BF16, Op>(dst, src, n, stream);
    case DType::U8: return launch_reduce<Native<uint8_t>, Op>(dst, src, n, stream);
    case DType::I8: return launch_reduce<Native<int8_t>, Op>(dst, src, n, stream);
    case DType::I16: return launch_reduce<Native<int16_t>, Op>(dst, src, n, stream);
    case DType::BOOL: return launch_reduce<Bool, Op>(dst, src, n, stream);
  }
  throw std::invalid_argument("reduce_cuda: unsupported dtype");
}

template <class E, class F>
void launch_scale(void* p, size_t n, F f, Stream stream) {
  using S = typename E::Storage;
  bool vec = cuda::aligned16(p);
  unsigned blocks = cuda::blocks_for(vec ? n / Pack<S>::N + 1 : n);
  scale_kernel<E, F><<<blocks, cuda::kThreads, 0, stream>>>(static_cast<S*>(p), n, f, vec);
  PYCOMM_CUDA_CHECK_LAUNCH();
}

}  // namespace

void reduce_cuda(void* dst, const void* src, size_t count, DType dtype, ReduceOp op, Stream stream) {
  if (count == 0) return;
  switch (op) {
    case ReduceOp::SUM: return reduce_typed<Sum>(dst, src, count, dtype, stream);
    case ReduceOp::MIN: return reduce_typed<Min>(dst, src, count, dtype, stream);
    case ReduceOp::MAX: return reduce_typed<Max>(dst, src, count, dtype, stream);
    case ReduceOp::PROD: return reduce_typed<Prod>(dst, src, count, dtype, stream);
  }
  throw std::invalid_argument("reduce_cuda: unsupported op");
}

void scale_cuda(void* dst, size_t count, DType dtype, double factor, Stream stream) {
  if (count == 0) return;
  const float f = static_cast<float>(factor);
  switch (dtype) {
    case DType::F32: return launch_scale<Native<float>>(dst, count, f, stream);
    case DType::F64: return launch_scale<Native<double>>(dst, count, factor, stream);
    case DType::F16: return launch_scale<F16>(dst, count, f, stream);
    case DType::BF16: return launch_scale<BF16>(dst, count, f, stream);
    default: throw std::invalid_argument("scale_cuda: integer tensors cannot be scaled");
  }
}

}  // namespace kernels
}  // namespace pycomm
