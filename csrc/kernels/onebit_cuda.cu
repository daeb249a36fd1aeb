// 1-bit quantization with error feedback on the GPU (math in onebit.h).
//
// Work is cut into (chunk, tile) items, a tile being at most kTile elements of
// one chunk, so one block never straddles two scales and the grid-stride loop
// runs over items. Chunks of at most kTile elements take one kernel (the
// block reduces its chunk's norm, then quantizes it from cache); longer
// chunks take two:
//   1. sums of squares (float64) and kept counts per item, reduced in the
//      block (warp shuffles + shared memory), then added atomically to the
//      chunk's slot in stream-ordered scratch;
//   2. per item: s = sqrt(sum / count); each warp takes 128 elements at a
//      time (one float4 per lane), forms c, q and the new residual, and packs
//      the signs with four __ballot_sync, one per float4 component, spread
//      into the 32-bit words of the little-endian bit stream.
// Decompression: one thread per bit byte (8 elements, two float4 stores).
// Scratch (float64 sums + counts, 16 bytes per chunk) is stream-ordered
// (cudaMallocAsync / cudaFreeAsync) on the caller's stream.
#include "cuda_check.h"
#include "onebit.h"

namespace pycomm {
namespace kernels {
namespace {

constexpr size_t kTile = 8192;  // elements per (chunk, tile) work item; a multiple of 128
constexpr unsigned kFull = 0xffffffffu;

struct Items {
  size_t n, chunk, tiles_per_chunk, count;
  __device__ void get(size_t item, size_t* chunk_index, size_t* begin, size_t* end) const {
    size_t j = item / tiles_per_chunk, t = item % tiles_per_chunk;
    size_t cb = j * chunk, ce = cb + chunk < n ? cb + chunk : n;
    size_t b = cb + t * kTile, e = b + kTile < ce ? b + kTile : ce;
    *chunk_index = j;
    *begin = b < ce ? b : ce;
    *end = e;
  }
};

Items make_items(size_t n, size_t chunk) {
  Items it;
  it.n = n;
  it.chunk = chunk;
  it.tiles_per_chunk = (chunk + kTile - 1) / kTile;
  it.count = onebit_num_chunks(n, chunk) * it.tiles_per_chunk;
  return it;
}

// Sum over the block of (double, count); the result is valid in thread 0.
__device__ void block_sum(double& s, unsigned long long& k) {
  __shared__ double ss[32];
  __shared__ unsigned long long ks[32];
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_down_sync(kFull, s, o);
    k += __shfl_down_sync(kFull, k, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  __syncthreads();  // the shared slots may still be read by the previous item
  if (lane == 0) {
    ss[warp] = s;
    ks[warp] = k;
  }
  __syncthreads();
  if (warp == 0) {
    s = lane < nw ? ss[lane] : 0.0;
    k = lane < nw ? ks[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) {
      s += __shfl_down_sync(kFull, s, o);
      k += __shfl_down_sync(kFull, k, o);
    }
  }
}

// Sum of squares of c = x + e over the kept elements of [b, end), and their
// count; valid in thread 0 after the call (block_sum).
__device__ void item_sumsq(const float* __restrict__ x, const float* __restrict__ e, const uint8_t* __restrict__ m,
                           size_t b, size_t end, bool vec, double& s, unsigned long long& k) {
  s = 0.0;
  k = 0;
  for (size_t i = b + 4 * size_t(threadIdx.x); i < end; i += 4 * size_t(blockDim.x)) {
    float c[4];
    bool kept[4];
    if (vec && i + 4 <= end) {
      float4 xv = *reinterpret_cast<const float4*>(x + i), ev = *reinterpret_cast<const float4*>(e + i);
      c[0] = __fadd_rn(xv.x, ev.x);
      c[1] = __fadd_rn(xv.y, ev.y);
      c[2] = __fadd_rn(xv.z, ev.z);
      c[3] = __fadd_rn(xv.w, ev.w);
      if (m) {
        uchar4 mv = *reinterpret_cast<const uchar4*>(m + i);
        kept[0] = mv.x;
        kept[1] = mv.y;
        kept[2] = mv.z;
        kept[3] = mv.w;
      } else {
        kept[0] = kept[1] = kept[2] = kept[3] = true;
      }
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        bool in = i + q < end;
        c[q] = in ? __fadd_rn(x[i + q], e[i + q]) : 0.0f;
        kept[q] = in && (!m || m[i + q]);
      }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (kept[q]) {
        double d = c[q];
        s = fma(d, d, s);
        ++k;
      }
    }
  }
  block_sum(s, k);
}

// Pass 1 for chunks longer than one tile: per-item sums added into the chunk's slot.
__global__ void sumsq_kernel(const float* __restrict__ x, const float* __restrict__ e, const uint8_t* __restrict__ m,
                             Items items, double* __restrict__ sums, unsigned long long* __restrict__ counts,
                             bool vec) {
  for (size_t item = blockIdx.x; item < items.count; item += gridDim.x) {
    size_t j, b, end;
    items.get(item, &j, &b, &end);
    double s;
    unsigned long long k;
    item_sumsq(x, e, m, b, end, vec, s, k);
    if (threadIdx.x == 0) {
      atomicAdd(sums + j, s);
      atomicAdd(counts + j, k);
    }
  }
}

// 8 bits -> bits 0, 4, 8, ..., 28.
__device__ __forceinline__ uint32_t spread4(uint32_t v) {
  v = (v | (v << 12)) & 0x000F000Fu;
  v = (v | (v << 6)) & 0x03030303u;
  v = (v | (v << 3)) & 0x11111111u;
  return v;
}

// FUSED: each chunk is one item (chunk <= kTile), so the block computes the
// chunk's scale itself and the second read of x and e comes from cache.
template <bool FUSED>
__global__ void quantize_kernel(const float* __restrict__ x, float* __restrict__ e, const uint8_t* __restrict__ m,
                                Items items, const double* __restrict__ sums,
                                const unsigned long long* __restrict__ counts, uint8_t* __restrict__ bits,
                                float* __restrict__ scales, bool vec) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __shared__ float shared_scale;
  for (size_t item = blockIdx.x; item < items.count; item += gridDim.x) {
    size_t j, b, end;
    items.get(item, &j, &b, &end);
    float s;
    if (FUSED) {
      double sum;
      unsigned long long cnt;
      item_sumsq(x, e, m, b, end, vec, sum, cnt);
      if (threadIdx.x == 0) {
        shared_scale = cnt ? static_cast<float>(sqrt(sum / static_cast<double>(cnt))) : 0.0f;
        scales[j] = shared_scale;
      }
      __syncthreads();
      s = shared_scale;
    } else {
      const unsigned long long cnt = counts[j];
      s = cnt ? static_cast<float>(sqrt(sums[j] / static_cast<double>(cnt))) : 0.0f;
      if (threadIdx.x == 0 && b == j * items.chunk) scales[j] = s;
    }
    for (size_t g = b + 128 * size_t(warp); g < end; g += 128 * size_t(nw)) {  // warp-uniform loop
      const size_t i = g + 4 * lane;
      float xs[4], es[4];
      bool in[4], kept[4];
      const bool full = vec && i + 4 <= end;
      if (full) {
        float4 xv = *reinterpret_cast<const float4*>(x + i), ev = *reinterpret_cast<const float4*>(e + i);
        xs[0] = xv.x, xs[1] = xv.y, xs[2] = xv.z, xs[3] = xv.w;
        es[0] = ev.x, es[1] = ev.y, es[2] = ev.z, es[3] = ev.w;
        uchar4 mv = m ? *reinterpret_cast<const uchar4*>(m + i) : make_uchar4(1, 1, 1, 1);
        kept[0] = mv.x, kept[1] = mv.y, kept[2] = mv.z, kept[3] = mv.w;
        in[0] = in[1] = in[2] = in[3] = true;
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          in[q] = i + q < end;
          xs[q] = in[q] ? x[i + q] : 0.0f;
          es[q] = in[q] ? e[i + q] : 0.0f;
          kept[q] = in[q] && (!m || m[i + q]);
        }
      }
      bool pos[4];
      float en[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float c = __fadd_rn(xs[q], es[q]);
        pos[q] = c >= 0.0f;
        en[q] = kept[q] ? __fsub_rn(c, pos[q] ? s : -s) : 0.0f;
        pos[q] = pos[q] && kept[q];
      }
      if (full) {
        *reinterpret_cast<float4*>(e + i) = make_float4(en[0], en[1], en[2], en[3]);
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (in[q]) e[i + q] = en[q];
      }
      // Element g + 32w + 4l + q is lane 8w + l, component q: bit 4l + q of word w.
      const uint32_t b0 = __ballot_sync(kFull, pos[0]), b1 = __ballot_sync(kFull, pos[1]);
      const uint32_t b2 = __ballot_sync(kFull, pos[2]), b3 = __ballot_sync(kFull, pos[3]);
      if ((lane & 7) == 0) {
        const int sh = lane;  // 8 * word index
        uint32_t word = spread4((b0 >> sh) & 0xffu) | (spread4((b1 >> sh) & 0xffu) << 1) |
                        (spread4((b2 >> sh) & 0xffu) << 2) | (spread4((b3 >> sh) & 0xffu) << 3);
        const size_t first = g + 4 * size_t(lane);  // first element of this word, a multiple of 8
        uint8_t* out = bits + first / 8;
        if (first + 32 <= end && (reinterpret_cast<uintptr_t>(out) & 3u) == 0) {
          *reinterpret_cast<uint32_t*>(out) = word;
        } else {
          for (int q = 0; q < 4; ++q)
            if (first + 8 * q < end) out[q] = static_cast<uint8_t>(word >> (8 * q));
        }
      }
    }
  }
}

template <bool ACC>
__global__ void dequantize_kernel(const uint8_t* __restrict__ bits, const float* __restrict__ scales, size_t n,
                                  size_t chunk, float* __restrict__ out, float weight,
                                  const uint8_t* __restrict__ m, bool vec) {
  const size_t nbytes = (n + 7) / 8;
  for (size_t byte = blockIdx.x * size_t(blockDim.x) + threadIdx.x; byte < nbytes;
       byte += size_t(gridDim.x) * blockDim.x) {
    const size_t i = 8 * byte;
    const float s = scales[i / chunk];
    const float v = ACC ? __fmul_rn(weight, s) : s;
    const unsigned bv = bits[byte];
    float q[8];
    bool kept[8];
    uint2 mv = make_uint2(0x01010101u, 0x01010101u);
    const bool full = vec && i + 8 <= n;
    if (m && full) mv = *reinterpret_cast<const uint2*>(m + i);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      bool in = i + k < n;
      if (m) kept[k] = full ? ((k < 4 ? mv.x >> (8 * k) : mv.y >> (8 * (k - 4))) & 0xffu) != 0 : (in && m[i + k]);
      else kept[k] = true;
      q[k] = kept[k] ? ((bv >> k) & 1u ? v : -v) : 0.0f;
    }
    if (full) {
      float4* o = reinterpret_cast<float4*>(out + i);
      float4 a = make_float4(q[0], q[1], q[2], q[3]), b = make_float4(q[4], q[5], q[6], q[7]);
      if (ACC) {  // masked elements keep their old value bit for bit
        float4 a0 = o[0], b0 = o[1];
        a = make_float4(kept[0] ? __fadd_rn(a0.x, a.x) : a0.x, kept[1] ? __fadd_rn(a0.y, a.y) : a0.y,
                        kept[2] ? __fadd_rn(a0.z, a.z) : a0.z, kept[3] ? __fadd_rn(a0.w, a.w) : a0.w);
        b = make_float4(kept[4] ? __fadd_rn(b0.x, b.x) : b0.x, kept[5] ? __fadd_rn(b0.y, b.y) : b0.y,
                        kept[6] ? __fadd_rn(b0.z, b.z) : b0.z, kept[7] ? __fadd_rn(b0.w, b.w) : b0.w);
      }
      o[0] = a;
      o[1] = b;
    } else {
      for (int k = 0; k < 8 && i + k < n; ++k) {
        if (!ACC) out[i + k] = q[k];
        else if (kept[k]) out[i + k] = __fadd_rn(out[i + k], q[k]);
      }
    }
  }
}

void dequantize(const uint8_t* bits, const float* scales, size_t n, size_t chunk, float* out, float weight,
                const uint8_t* mask, bool acc, Stream stream) {
  onebit_check_chunk(chunk);
  if (n == 0) return;
  // out: 32-byte steps from a 16-byte aligned base; mask: 8-byte steps from an 8-byte aligned base.
  bool vec = cuda::aligned16(out) && (!mask || (reinterpret_cast<uintptr_t>(mask) & 7u) == 0);
  unsigned blocks = cuda::blocks_for((n + 7) / 8);
  if (acc) dequantize_kernel<true><<<blocks, cuda::kThreads, 0, stream>>>(bits, scales, n, chunk, out, weight, mask, vec);
  else dequantize_kernel<false><<<blocks, cuda::kThreads, 0, stream>>>(bits, scales, n, chunk, out, weight, mask, vec);
  PYCOMM_CUDA_CHECK_LAUNCH();
}

}  // namespace

void onebit_compress_cuda(const float* x, float* residual, size_t n, size_t chunk, uint8_t* bits, float* scales,
                          const uint8_t* mask, Stream stream) {
  onebit_check_chunk(chunk);
  if (n == 0) return;
  Items items = make_items(n, chunk);
  const size_t nc = onebit_num_chunks(n, chunk);
  // Item starts are multiples of 8 elements: float4 loads need 16-byte aligned x and e, uchar4 mask loads 4-byte.
  bool vec = cuda::aligned16(x) && cuda::aligned16(residual) &&
             (!mask || (reinterpret_cast<uintptr_t>(mask) & 3u) == 0);
  unsigned blocks = cuda::blocks_for(items.count, 1);
  if (items.tiles_per_chunk == 1) {  // one pass: a block per chunk computes its own scale
    quantize_kernel<true><<<blocks, cuda::kThreads, 0, stream>>>(x, residual, mask, items, nullptr, nullptr, bits,
                                                                 scales, vec);
    PYCOMM_CUDA_CHECK_LAUNCH();
    return;
  }
  void* scratch = nullptr;
  const size_t scratch_bytes = nc * (sizeof(double) + sizeof(unsigned long long));
  PYCOMM_CUDA_CHECK(cudaMallocAsync(&scratch, scratch_bytes, stream));
  auto* sums = static_cast<double*>(scratch);
  auto* counts = reinterpret_cast<unsigned long long*>(sums + nc);
  PYCOMM_CUDA_CHECK(cudaMemsetAsync(scratch, 0, scratch_bytes, stream));
  sumsq_kernel<<<blocks, cuda::kThreads, 0, stream>>>(x, residual, mask, items, sums, counts, vec);
  PYCOMM_CUDA_CHECK_LAUNCH();
  quantize_kernel<false><<<blocks, cuda::kThreads, 0, stream>>>(x, residual, mask, items, sums, counts, bits, scales,
                                                                vec);
  PYCOMM_CUDA_CHECK_LAUNCH();
  PYCOMM_CUDA_CHECK(cudaFreeAsync(scratch, stream));
}

void onebit_decompress_cuda(const uint8_t* bits, const float* scales, size_t n, size_t chunk, float* out,
                            const uint8_t* mask, Stream stream) {
  dequantize(bits, scales, n, chunk, out, 1.0f, mask, false, stream);
}

void onebit_decompress_accumulate_cuda(const uint8_t* bits, const float* scales, size_t n, size_t chunk, float* out,
                                       float weight, const uint8_t* mask, Stream stream) {
  dequantize(bits, scales, n, chunk, out, weight, mask, true, stream);
}

}  // namespace kernels
}  // namespace pycomm
