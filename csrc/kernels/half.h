// Scalar fp16 / bf16 <-> fp32 conversions, round-to-nearest-even, NaN kept NaN.
// Written with integer operations only so that loops over them vectorize on any
// ISA; the fp16 path uses the compiler's _Float16 where it exists, which turns
// into F16C instructions inside functions compiled for x86-64-v3.
#pragma once
#include <cstdint>
#include <cstring>

namespace pycomm {
namespace kernels {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

// fp16 -> fp32, exact for every input (subnormals, inf, NaN payloads). Branch
// free, so loops over it vectorize with any ISA.
inline float half_to_float(uint16_t h) {
  uint32_t o = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent and mantissa in place
  uint32_t e = o & 0x0f800000u;
  uint32_t normal = o + (112u << 23);                        // rebias 15 -> 127
  uint32_t infnan = o + (224u << 23);
  uint32_t sub = float_to_bits(bits_to_float(o + (113u << 23)) - bits_to_float(113u << 23));
  uint32_t r = e == 0x0f800000u ? infnan : (e == 0 ? sub : normal);
  return bits_to_float(r | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

#if defined(__FLT16_MAX__)
#define PYCOMM_HAVE_FLOAT16 1
inline uint16_t float_to_half(float f) {
  _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, sizeof h);
  return h;
}
#else
// IEEE binary16 by bit manipulation (no _Float16 in this compiler).
inline uint16_t float_to_half(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  if (a < 0x38800000u) {                          // subnormal or zero in fp16
    float v = bits_to_float(a) * 16777216.0f;     // scale to units of 2^-24
    uint32_t m = static_cast<uint32_t>(v);
    float rem = v - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return sign | static_cast<uint16_t>(m);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return sign | static_cast<uint16_t>(r >> 13);
}
#endif

}  // namespace kernels
}  // namespace pycomm
