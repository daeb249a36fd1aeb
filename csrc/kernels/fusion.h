// Tensor fusion (docs/algorithms.md §1-2): many tensors of one dtype copied into
// one flat buffer and back in one call (one kernel launch on the GPU).
// Tensor k occupies elements [off_k, off_k + counts[k]) of the flat buffer,
// off_k = counts[0] + ... + counts[k-1] (packed back to back, no padding).
#pragma once
#include <cstddef>

#include "dtype.h"
#include "stream.h"

namespace pycomm {
namespace kernels {

// flat[off_k + i] = srcs[k][i]
void fusion_pack_cpu(const void* const* srcs, const size_t* counts, size_t num, void* flat, DType dtype);
// dsts[k][i] = flat[off_k + i] * scale. scale == 1 is a plain copy (any dtype); otherwise floating
// types only, fp16/bf16 scaled in fp32 and rounded once.
void fusion_unpack_cpu(const void* flat, void* const* dsts, const size_t* counts, size_t num, DType dtype,
                       double scale);

// Same on the GPU. The pointer tables are host arrays of device pointers; the
// call copies them to stream-ordered device scratch and launches one kernel.
void fusion_pack_cuda(const void* const* srcs, const size_t* counts, size_t num, void* flat, DType dtype,
                      Stream stream);
void fusion_unpack_cuda(const void* flat, void* const* dsts, const size_t* counts, size_t num, DType dtype,
                        double scale, Stream stream);

// The same with the piece table in memory the caller keeps (no allocation per call): `host_table`
// (pinned host memory) and `table` (device memory) of at least fusion_table_bytes(...) bytes each.
// The host table is written at once and copied to `table` on `stream`; the caller must not rewrite
// it before that copy has run (an event recorded after the call tells).
size_t fusion_table_bytes(const size_t* counts, size_t num, DType dtype);
void fusion_pack_cuda(const void* const* srcs, const size_t* counts, size_t num, void* flat, DType dtype,
                      void* host_table, void* table, Stream stream);
void fusion_unpack_cuda(const void* flat, void* const* dsts, const size_t* counts, size_t num, DType dtype,
                        double scale, void* host_table, void* table, Stream stream);

// Throws std::invalid_argument for a scale != 1 on an integer dtype.
void fusion_check_scale(DType dtype, double scale);

}  // namespace kernels
}  // namespace pycomm
