// Fusion pack/unpack on the CPU: tensors are cut into pieces of at most
// kPieceBytes so that a few large tensors and many small ones spread evenly
// over the OpenMP threads; each piece is a memcpy or one scaled loop.
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cast.h"
#include "cpu_dispatch.h"
#include "fusion.h"
#include "half.h"
#include "reduce.h"

namespace pycomm {
namespace kernels {
namespace {

constexpr size_t kPieceBytes = size_t(256) << 10;

struct Piece {
  size_t tensor, begin, count;  // elements [begin, begin+count) of tensor `tensor`
  size_t flat;                  // element offset in the flat buffer
};

std::vector<Piece> make_pieces(const size_t* counts, size_t num, size_t esize, size_t* total) {
  std::vector<Piece> pieces;
  const size_t per = kPieceBytes / esize;
  size_t off = 0;
  for (size_t k = 0; k < num; ++k) {
    for (size_t b = 0; b < counts[k]; b += per) pieces.push_back({k, b, std::min(per, counts[k] - b), off + b});
    off += counts[k];
  }
  *total = off;
  return pieces;
}

template <class F>
void run_pieces(const std::vector<Piece>& pieces, size_t bytes, F&& f) {
  const long np = static_cast<long>(pieces.size());
  const int nt = threads_for(bytes);
  if (nt <= 1 || np <= 1) {
    // Not through the OpenMP runtime: a dynamic loop whose `if` clause is false still takes a
    // runtime call per piece, 6% of a fused step of 400 small tensors (perf, bench/fusion.py).
    for (const Piece& p : pieces) f(p);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (long p = 0; p < np; ++p) f(pieces[static_cast<size_t>(p)]);
}

template <class T>
PYCOMM_CPU_CLONES void scale_copy(T* __restrict dst, const T* __restrict src, size_t n, T s) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = src[i] * s;
}
void scaled(void* dst, const void* src, size_t n, DType t, double s) {
  switch (t) {
    case DType::F32:
      return scale_copy<float>(static_cast<float*>(dst), static_cast<const float*>(src), n, static_cast<float>(s));
    case DType::F64: return scale_copy<double>(static_cast<double*>(dst), static_cast<const double*>(src), n, s);
    case DType::F16:
    case DType::BF16: return scale_half_cpu(src, dst, n, t, static_cast<float>(s));
    default: throw std::invalid_argument("fusion: integer tensors cannot be scaled");
  }
}

}  // namespace

void fusion_check_scale(DType dtype, double scale) {
  if (scale != 1.0 && !is_floating(dtype))
    throw std::invalid_argument(std::string("fusion_unpack: scale ") + std::to_string(scale) + " on " +
                                dtype_name(dtype) + " tensors; integer tensors take scale 1 only");
}

void fusion_pack_cpu(const void* const* srcs, const size_t* counts, size_t num, void* flat, DType dtype) {
  const size_t es = dtype_size(dtype);
  size_t total;
  auto pieces = make_pieces(counts, num, es, &total);
  char* out = static_cast<char*>(flat);
  run_pieces(pieces, total * es * 2, [&](const Piece& p) {
    std::memcpy(out + p.flat * es, static_cast<const char*>(srcs[p.tensor]) + p.begin * es, p.count * es);
  });
}

void fusion_unpack_cpu(const void* flat, void* const* dsts, const size_t* counts, size_t num, DType dtype,
                       double scale) {
  fusion_check_scale(dtype, scale);
  const size_t es = dtype_size(dtype);
  size_t total;
  auto pieces = make_pieces(counts, num, es, &total);
  const char* in = static_cast<const char*>(flat);
  run_pieces(pieces, total * es * 2, [&](const Piece& p) {
    char* d = static_cast<char*>(dsts[p.tensor]) + p.begin * es;
    if (scale == 1.0) std::memcpy(d, in + p.flat * es, p.count * es);
    else scaled(d, in + p.flat * es, p.count, dtype, scale);
  });
}

}  // namespace kernels
}  // namespace pycomm
