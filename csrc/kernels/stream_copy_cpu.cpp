#include "stream_copy.h"

#include <cstdint>
#include <cstring>

#include "cpu_dispatch.h"
#ifdef PYCOMM_X86
#include <immintrin.h>
#endif

namespace pycomm {
namespace kernels {

void stream_copy_cpu(void* dst, const void* src, size_t bytes) {
#ifdef PYCOMM_X86
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  // Streaming stores need 16-byte aligned destinations: the unaligned head goes through memcpy.
  const size_t head = std::min<size_t>(bytes, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
  std::memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {  // one cache line a step (SSE2: every x86-64 CPU)
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  for (; i + 16 <= bytes; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  std::memcpy(d + i, s + i, bytes - i);
  _mm_sfence();  // streaming stores are weakly ordered: order them before whatever the caller stores next
#else
  std::memcpy(dst, src, bytes);
#endif
}

}  // namespace kernels
}  // namespace pycomm
