// 1-bit quantization with error feedback (docs/algorithms.md §2; Seide et al.
// 2014, DeepSpeed 1-bit Adam).
//
// A buffer of n floats is split into chunks of `chunk` elements (chunk > 0, a
// multiple of 8; the last chunk holds the rest and may be short), each with
// its own scale. For chunk j with residual e:
//   c = x + e                                  (float32)
//   s_j = ||c_j||_2 / sqrt(n_j)                (sum of squares in float64, s_j rounded to float32;
//                                               s_j = 0 when n_j = 0)
//   bit_i = (c_i >= 0)                          (zero and -0 give 1, NaN gives 0)
//   q_i = s_j * (2 bit_i - 1)
//   e_i <- c_i - q_i                           (float32, one rounding: e = fl(c - q))
// Bit i lives in byte i/8 at bit position i%8 (little-endian), so chunk j's
// bits start at byte (j*chunk)/8 and the whole stream is
// onebit_packed_bytes(n) = ceil(n/8) bytes; bits past n in the last byte are 0.
//
// Mask (optional, one byte per element, nullptr = all kept): an element whose
// mask byte is 0 is "masked out": it is left out of the norm and of n_j
// (n_j counts the kept elements of chunk j), its q is 0, its residual is set
// to exactly 0, its bit is written as 0 and carries no meaning. Decompress
// needs the same mask to give 0 there (like DeepSpeed's exp_avg_mask).
//
// x and residual must not overlap; out must not overlap bits/scales. Every
// function reads and writes only inside [0, n) of its arrays, ceil(n/8) bit
// bytes and ceil(n/chunk) scales. CUDA variants take device pointers, run on
// `stream` and use a few bytes of stream-ordered scratch memory.
#pragma once
#include <cstddef>
#include <cstdint>

#include "stream.h"

namespace pycomm {
namespace kernels {

// Bytes of packed sign bits for n elements: ceil(n/8).
inline size_t onebit_packed_bytes(size_t n) { return (n + 7) / 8; }
// Number of chunks (= scales) for n elements: ceil(n/chunk).
inline size_t onebit_num_chunks(size_t n, size_t chunk) { return chunk ? (n + chunk - 1) / chunk : 0; }

// bits, scales <- quantize(x + residual); residual <- (x + residual) - q.
void onebit_compress_cpu(const float* x, float* residual, size_t n, size_t chunk, uint8_t* bits, float* scales,
                         const uint8_t* mask);
// out[i] = q_i = s_j * (2 bit_i - 1)   (0 where mask is 0)
void onebit_decompress_cpu(const uint8_t* bits, const float* scales, size_t n, size_t chunk, float* out,
                           const uint8_t* mask);
// out[i] += fl(weight * s_j) * (2 bit_i - 1)   (unchanged where mask is 0); weight 1 adds q exactly.
void onebit_decompress_accumulate_cpu(const uint8_t* bits, const float* scales, size_t n, size_t chunk, float* out,
                                      float weight, const uint8_t* mask);

void onebit_compress_cuda(const float* x, float* residual, size_t n, size_t chunk, uint8_t* bits, float* scales,
                          const uint8_t* mask, Stream stream);
void onebit_decompress_cuda(const uint8_t* bits, const float* scales, size_t n, size_t chunk, float* out,
                            const uint8_t* mask, Stream stream);
void onebit_decompress_accumulate_cuda(const uint8_t* bits, const float* scales, size_t n, size_t chunk, float* out,
                                       float weight, const uint8_t* mask, Stream stream);

// Throws std::invalid_argument unless chunk > 0 and chunk % 8 == 0.
void onebit_check_chunk(size_t chunk);

}  // namespace kernels
}  // namespace pycomm
