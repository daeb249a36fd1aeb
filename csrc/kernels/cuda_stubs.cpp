// CPU-only builds: the CUDA kernels are declared in the headers but not
// compiled. These definitions keep every caller linkable and fail clearly if
// one is reached (the bindings refuse CUDA tensors before that).
#ifndef PYCOMM_WITH_CUDA
#include <stdexcept>
#include <string>

#include "cast.h"
#include "fusion.h"
#include "onebit.h"
#include "reduce.h"
#include "sparse.h"

namespace pycomm {
namespace kernels {
namespace {
[[noreturn]] void no_cuda(const char* fn) {
  throw std::runtime_error(std::string(fn) + ": pycomm was built without CUDA; reinstall with a CUDA build of torch "
                           "(PYCOMM_CUDA=1)");
}
}  // namespace

void cast_to_half_cuda(const float*, void*, size_t, DType, float, int*, Stream) { no_cuda("cast_to_half_cuda"); }
void cast_to_float_cuda(const void*, float*, size_t, DType, float, Stream) { no_cuda("cast_to_float_cuda"); }
void accumulate_half_cuda(float*, const void*, size_t, DType, Stream) { no_cuda("accumulate_half_cuda"); }
void onebit_compress_cuda(const float*, float*, size_t, size_t, uint8_t*, float*, const uint8_t*, Stream) {
  no_cuda("onebit_compress_cuda");
}
void onebit_decompress_cuda(const uint8_t*, const float*, size_t, size_t, float*, const uint8_t*, Stream) {
  no_cuda("onebit_decompress_cuda");
}
void onebit_decompress_accumulate_cuda(const uint8_t*, const float*, size_t, size_t, float*, float, const uint8_t*,
                                       Stream) {
  no_cuda("onebit_decompress_accumulate_cuda");
}
void fusion_pack_cuda(const void* const*, const size_t*, size_t, void*, DType, Stream) { no_cuda("fusion_pack_cuda"); }
void fusion_unpack_cuda(const void*, void* const*, const size_t*, size_t, DType, double, Stream) {
  no_cuda("fusion_unpack_cuda");
}
size_t fusion_table_bytes(const size_t*, size_t, DType) { no_cuda("fusion_table_bytes"); }
void fusion_pack_cuda(const void* const*, const size_t*, size_t, void*, DType, void*, void*, Stream) {
  no_cuda("fusion_pack_cuda");
}
void fusion_unpack_cuda(const void*, void* const*, const size_t*, size_t, DType, double, void*, void*, Stream) {
  no_cuda("fusion_unpack_cuda");
}
void reduce_cuda(void*, const void*, size_t, DType, ReduceOp, Stream) { no_cuda("reduce_cuda"); }
void scale_cuda(void*, size_t, DType, double, Stream) { no_cuda("scale_cuda"); }
size_t sparse_count_above_cuda(const float*, const float*, size_t, float, Stream) {
  no_cuda("sparse_count_above_cuda");
}
void sparse_select_cuda(const float*, float*, size_t, size_t, int32_t*, float*, Stream) {
  no_cuda("sparse_select_cuda");
}
void sparse_scatter_cuda(const int32_t*, const float*, size_t, size_t, float*, size_t, float, Stream) {
  no_cuda("sparse_scatter_cuda");
}

}  // namespace kernels
}  // namespace pycomm
#endif  // PYCOMM_WITH_CUDA
