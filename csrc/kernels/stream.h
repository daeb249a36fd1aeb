// The CUDA stream type, without CUDA headers: cudaStream_t is CUstream_st*.
// CPU-only builds declare the CUDA kernels too; they are defined only when
// the extension is built with CUDA (PYCOMM_WITH_CUDA).
#pragma once

struct CUstream_st;

namespace pycomm {
namespace kernels {
using Stream = CUstream_st*;  // nullptr = the legacy default stream
}  // namespace kernels
}  // namespace pycomm
