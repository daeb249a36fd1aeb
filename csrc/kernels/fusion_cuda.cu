// Fusion pack/unpack on the GPU in one launch. The host cuts every tensor
// into pieces of at most kPieceBytes, copies the piece table (source,
// destination, length) to device memory (stream-ordered scratch, or the
// caller's cached table from its pinned host table), and one kernel
// grid-strides over the pieces, a block per piece. A piece is copied with
// 16-byte vectors when source and destination share their alignment mod 16
// (head and tail bytes done singly), else with the widest word they share;
// a scaled unpack converts element by element inside 16-byte packs.
#include <vector>

#include "cuda_check.h"
#include "fusion.h"

namespace pycomm {
namespace kernels {
namespace {

using cuda::Pack;

constexpr size_t kPieceBytes = size_t(64) << 10;

struct Piece {
  const char* src;
  char* dst;
  unsigned long long bytes;
};

template <class W>
__device__ void copy_words(char* __restrict__ dst, const char* __restrict__ src, size_t bytes) {
  const size_t head = ((sizeof(W) - (reinterpret_cast<uintptr_t>(dst) & (sizeof(W) - 1))) & (sizeof(W) - 1));
  const size_t h = head < bytes ? head : bytes;
  for (size_t i = threadIdx.x; i < h; i += blockDim.x) dst[i] = src[i];
  const size_t nw = (bytes - h) / sizeof(W);
  W* d = reinterpret_cast<W*>(dst + h);
  const W* s = reinterpret_cast<const W*>(src + h);
  for (size_t i = threadIdx.x; i < nw; i += blockDim.x) d[i] = s[i];
  for (size_t i = h + nw * sizeof(W) + threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
}

__global__ void copy_kernel(const Piece* __restrict__ pieces, size_t np) {
  for (size_t p = blockIdx.x; p < np; p += gridDim.x) {
    const Piece pc = pieces[p];
    const uintptr_t diff = reinterpret_cast<uintptr_t>(pc.src) ^ reinterpret_cast<uintptr_t>(pc.dst);
    if ((diff & 15u) == 0) copy_words<uint4>(pc.dst, pc.src, pc.bytes);
    else if ((diff & 7u) == 0) copy_words<uint2>(pc.dst, pc.src, pc.bytes);
    else if ((diff & 3u) == 0) copy_words<uint32_t>(pc.dst, pc.src, pc.bytes);
    else if ((diff & 1u) == 0) copy_words<uint16_t>(pc.dst, pc.src, pc.bytes);
    else copy_words<uint8_t>(pc.dst, pc.src, pc.bytes);
  }
}

template <class S> struct Native {
  __device__ static S scale(S v, double f) { return static_cast<S>(v * static_cast<S>(f)); }
};
template <> struct Native<float> {
  __device__ static float scale(float v, double f) { return __fmul_rn(v, static_cast<float>(f)); }
};
template <> struct Native<double> {
  __device__ static double scale(double v, double f) { return __dmul_rn(v, f); }
};
struct F16 {
  __device__ static uint16_t scale(uint16_t v, double f) {
    return cuda::float_to_f16(__fmul_rn(cuda::f16_to_float(v), static_cast<float>(f)));
  }
};
struct BF16 {
  __device__ static uint16_t scale(uint16_t v, double f) {
    return cuda::float_to_bf16(__fmul_rn(cuda::bf16_to_float(v), static_cast<float>(f)));
  }
};

template <class T, class E>
__global__ void scale_kernel(const Piece* __restrict__ pieces, size_t np, double f) {
  for (size_t p = blockIdx.x; p < np; p += gridDim.x) {
    const Piece pc = pieces[p];
    const T* src = reinterpret_cast<const T*>(pc.src);
    T* dst = reinterpret_cast<T*>(pc.dst);
    const size_t n = pc.bytes / sizeof(T);
    size_t h = n;  // elements done one by one before the packs
    const uintptr_t diff = reinterpret_cast<uintptr_t>(pc.src) ^ reinterpret_cast<uintptr_t>(pc.dst);
    if ((diff & 15u) == 0) {
      h = ((16 - (reinterpret_cast<uintptr_t>(dst) & 15u)) & 15u) / sizeof(T);
      if (h > n) h = n;
    }
    for (size_t i = threadIdx.x; i < h; i += blockDim.x) dst[i] = E::scale(src[i], f);
    if (h == n) continue;
    const size_t nv = (n - h) / Pack<T>::N;
    const auto* s = reinterpret_cast<const Pack<T>*>(src + h);
    auto* d = reinterpret_cast<Pack<T>*>(dst + h);
    for (size_t i = threadIdx.x; i < nv; i += blockDim.x) {
      Pack<T> v = s[i];
#pragma unroll
      for (int k = 0; k < Pack<T>::N; ++k) v.v[k] = E::scale(v.v[k], f);
      d[i] = v;
    }
    for (size_t i = h + nv * Pack<T>::N + threadIdx.x; i < n; i += blockDim.x) dst[i] = E::scale(src[i], f);
  }
}

// The pieces of every tensor, at most kPieceBytes each: {tensor part, flat part, length}, written
// to `out` (pieces_of() of them) in tensor order.
size_t pieces_of(const size_t* counts, size_t num, size_t es) {
  size_t n = 0;
  for (size_t k = 0; k < num; ++k) n += (counts[k] * es + kPieceBytes - 1) / kPieceBytes;
  return n;
}

void fill(Piece* out, const void* const* tensors, const size_t* counts, size_t num, const void* flat, bool pack,
          size_t es) {
  size_t off = 0, i = 0;
  for (size_t k = 0; k < num; ++k) {
    const size_t bytes = counts[k] * es;
    const char* t = static_cast<const char*>(tensors[k]);
    const char* f = static_cast<const char*>(flat) + off;
    for (size_t b = 0; b < bytes; b += kPieceBytes) {
      size_t len = bytes - b < kPieceBytes ? bytes - b : kPieceBytes;
      if (pack) out[i++] = {t + b, const_cast<char*>(f + b), len};
      else out[i++] = {f + b, const_cast<char*>(t + b), len};
    }
    off += bytes;
  }
}

void launch(const Piece* tp, size_t np, DType dtype, double scale, Stream stream) {
  unsigned blocks = cuda::blocks_for(np, 1);
  if (scale == 1.0) {
    copy_kernel<<<blocks, cuda::kThreads, 0, stream>>>(tp, np);
  } else {
    switch (dtype) {
      case DType::F32: scale_kernel<float, Native<float>><<<blocks, cuda::kThreads, 0, stream>>>(tp, np, scale); break;
      case DType::F64: scale_kernel<double, Native<double>><<<blocks, cuda::kThreads, 0, stream>>>(tp, np, scale); break;
      case DType::F16: scale_kernel<uint16_t, F16><<<blocks, cuda::kThreads, 0, stream>>>(tp, np, scale); break;
      case DType::BF16: scale_kernel<uint16_t, BF16><<<blocks, cuda::kThreads, 0, stream>>>(tp, np, scale); break;
      default: break;  // rejected by fusion_check_scale
    }
  }
  PYCOMM_CUDA_CHECK_LAUNCH();
}

// pack: src = tensors, dst = flat; unpack: the other way round. The table in stream-ordered scratch.
void run(const void* const* tensors, const size_t* counts, size_t num, const void* flat, bool pack, DType dtype,
         double scale, Stream stream) {
  const size_t es = dtype_size(dtype);
  std::vector<Piece> pieces(pieces_of(counts, num, es));
  if (pieces.empty()) return;
  fill(pieces.data(), tensors, counts, num, flat, pack, es);
  void* table = nullptr;
  const size_t table_bytes = pieces.size() * sizeof(Piece);
  PYCOMM_CUDA_CHECK(cudaMallocAsync(&table, table_bytes, stream));
  // From pageable memory: returns once the table is staged, so `pieces` may go.
  PYCOMM_CUDA_CHECK(cudaMemcpyAsync(table, pieces.data(), table_bytes, cudaMemcpyHostToDevice, stream));
  launch(static_cast<const Piece*>(table), pieces.size(), dtype, scale, stream);
  PYCOMM_CUDA_CHECK(cudaFreeAsync(table, stream));
}

// The same with the caller's pinned host table and device table.
void run_ws(const void* const* tensors, const size_t* counts, size_t num, const void* flat, bool pack, DType dtype,
            double scale, void* host_table, void* table, Stream stream) {
  const size_t es = dtype_size(dtype);
  const size_t np = pieces_of(counts, num, es);
  if (np == 0) return;
  fill(static_cast<Piece*>(host_table), tensors, counts, num, flat, pack, es);
  PYCOMM_CUDA_CHECK(cudaMemcpyAsync(table, host_table, np * sizeof(Piece), cudaMemcpyHostToDevice, stream));
  launch(static_cast<const Piece*>(table), np, dtype, scale, stream);
}

}  // namespace

void fusion_pack_cuda(const void* const* srcs, const size_t* counts, size_t num, void* flat, DType dtype,
                      Stream stream) {
  run(srcs, counts, num, flat, true, dtype, 1.0, stream);
}

void fusion_unpack_cuda(const void* flat, void* const* dsts, const size_t* counts, size_t num, DType dtype,
                        double scale, Stream stream) {
  fusion_check_scale(dtype, scale);
  run(const_cast<const void* const*>(dsts), counts, num, flat, false, dtype, scale, stream);
}

size_t fusion_table_bytes(const size_t* counts, size_t num, DType dtype) {
  return pieces_of(counts, num, dtype_size(dtype)) * sizeof(Piece);
}

void fusion_pack_cuda(const void* const* srcs, const size_t* counts, size_t num, void* flat, DType dtype,
                      void* host_table, void* table, Stream stream) {
  run_ws(srcs, counts, num, flat, true, dtype, 1.0, host_table, table, stream);
}

void fusion_unpack_cuda(const void* flat, void* const* dsts, const size_t* counts, size_t num, DType dtype,
                        double scale, void* host_table, void* table, Stream stream) {
  fusion_check_scale(dtype, scale);
  run_ws(const_cast<const void* const*>(dsts), counts, num, flat, false, dtype, scale, host_table, table, stream);
}

}  // namespace kernels
}  // namespace pycomm
