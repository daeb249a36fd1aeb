// memcpy with non-temporal (streaming) stores: the destination's cache lines are written without
// being read for ownership and are not kept in this core's cache. Worth it where another core
// holds those lines from an earlier read (the shared window: comm/window_copy.h), since an ordinary
// store must first invalidate each of them there. Ends with a store fence, so the bytes are
// ordered before any later store (a barrier's release). Not x86-64: plain memcpy.
#pragma once
#include <cstddef>

namespace pycomm {
namespace kernels {

void stream_copy_cpu(void* dst, const void* src, size_t bytes);

}  // namespace kernels
}  // namespace pycomm
