// Compressed allreduce of tensors in device memory (compressed_allreduce.h
// gives the math; it is the flat form's, step for step). Every kernel --
// cast, sign packing, scales, error feedback, the server's sum -- runs on the
// tensor's memory through its DeviceOps table; only the compressed bytes
// cross MPI:
//   direct (CUDA-aware MPI): MPI reads and writes the device buffers;
//   staged: the compressed bytes go through the engine's pinned host chunks
//     (fp16/bf16: the double-buffered pipeline of staging.h, with the ring's
//     sums on the host; onebit: its all-to-all and allgather blocks, n/8 + 4N
//     bytes, one copy down and one up for each).
// Working memory comes from the table's workspace (cached, grows 2x, bounded
// by PYCOMM_DEVICE_CACHE_MB), the
// ring's slots from the MemoryMover's, so a steady stream of calls allocates
// nothing.
#include <mpi.h>

#include <cstring>

#include "algorithms.h"
#include "compressed_allreduce.h"
#include "device_ops.h"
#include "staging.h"
#include "timeline.h"

namespace pycomm {
namespace comm {
namespace {

constexpr size_t kAlign = 256;
size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

void check_int(size_t bytes, const char* what) {
  if (bytes > static_cast<size_t>(INT32_MAX))
    throw CommError(std::string("compressed allreduce: ") + what + " is larger than 2 GiB per rank");
}

// MPI_Alltoall (each rank sends `block` bytes to every rank) or MPI_Allgather
// (each rank's one block to all) between two buffers of the table's memory.
void exchange(bool alltoall, const void* send, void* recv, size_t block, MPI_Comm comm, int size, DeviceOps& ops,
              const DeviceWire& w) {
  const int b = static_cast<int>(block);
  if (size == 1) {
    ops.copy(recv, send, block);
    return;
  }
  const size_t send_bytes = alltoall ? block * static_cast<size_t>(size) : block;
  const size_t recv_bytes = block * static_cast<size_t>(size);
  const void* s = send;
  void* r = recv;
  if (!w.direct) {  // down to the pinned host chunks, MPI there, back up
    w.staging.reserve(w.mover, recv_bytes);
    w.mover.to_host_async(w.staging.chunk[0], send, send_bytes, 0);
    w.mover.wait_lane(0);
    s = w.staging.chunk[0];
    r = w.staging.chunk[1];
  }
  if (alltoall)
    PYCOMM_MPI_CHECK(MPI_Alltoall(s, b, MPI_BYTE, r, b, MPI_BYTE, comm));
  else
    PYCOMM_MPI_CHECK(MPI_Allgather(s, b, MPI_BYTE, r, b, MPI_BYTE, comm));
  if (!w.direct) {
    w.mover.to_device_async(recv, w.staging.chunk[1], recv_bytes, 0);
    w.mover.wait_lane(0);
  }
}

void device_half(const CompressedArgs& a, MPI_Comm comm, int size, DeviceOps& ops, const DeviceWire& w) {
  const size_t n = a.input.count;
  const DType half = a.compression == Compression::BF16 ? DType::BF16 : DType::F16;
  DeviceOps::Workspace ws = ops.workspace(w.owner, n * 2, w.cache_limit);
  void* h = ws.get();
  // Pre-divided cast: y = half(x / N) for an average.
  const float scale = a.average ? 1.0f / static_cast<float>(size) : 1.0f;
  timeline::Phase phase("COMPRESS");
  const int bad = ops.cast_to_half(static_cast<const float*>(a.input.data), h, n, half, scale);
  compressed_detail::agree_finite(bad, comm, size, a, compressed_detail::half_input_problem(half, a.average));
  Buffer hb = a.input;
  hb.data = h;
  hb.dtype = half;
  phase.next("RING");
  // The ring sums the half buffer, combining partial sums in fp32 on every hop:
  // on the device (the mover's reduce) when direct, on the host chunks when staged.
  if (size > 1) {
    if (w.direct) {
      ring_allreduce(hb, ReduceOp::SUM, comm, w.ring_chunk_bytes, &w.mover);
    } else {
      staged_allreduce(hb, hb, w.mover, w.staging, w.staging_chunk_bytes, [&](const Buffer& chunk) {
        ring_allreduce(chunk, ReduceOp::SUM, comm, w.ring_chunk_bytes);
      });
    }
  }
  phase.next("DECOMPRESS");
  // Inputs were finite (checked above), so inf/NaN now is an overflow on the way (compressed_allreduce.cpp).
  if (half == DType::F16 && ops.any_nonfinite_half(h, n, half)) compressed_detail::throw_fp16_overflow(a);
  ops.cast_to_float(h, static_cast<float*>(a.output.data), n, half);
}

void device_onebit(const CompressedArgs& a, MPI_Comm comm, int rank, int size, DeviceOps& ops,
                   const DeviceWire& w) {
  const size_t n = a.input.count;
  const uint8_t* mask = static_cast<const uint8_t*>(a.mask.data);
  compressed_detail::agree_finite(ops.any_nonfinite(static_cast<const float*>(a.input.data), mask, n), comm, size,
                                  a, "inf or NaN");
  const float weight = a.average ? 1.0f / static_cast<float>(size) : 1.0f;
  const OneBitLayout L = onebit_layout(n, size);
  const size_t B = L.block_bytes(), bits = L.bit_bytes(), m = L.chunk, N = static_cast<size_t>(size);
  check_int(B, "a 1-bit chunk");

  // Workspace: send, recv, gathered blocks (B N bytes each; bits then an
  // unaligned scale, the wire format), the server's float32 sum (m), and the
  // scales copied to aligned floats for the kernels (N).
  const size_t blocks = aligned(B * N);
  DeviceOps::Workspace lease = ops.workspace(w.owner, 3 * blocks + aligned(m * 4) + aligned(N * 4), w.cache_limit);
  uint8_t* ws = static_cast<uint8_t*>(lease.get());
  uint8_t* send = ws;
  uint8_t* recv = ws + blocks;
  uint8_t* gathered = ws + 2 * blocks;
  float* acc = reinterpret_cast<float*>(ws + 3 * blocks);
  float* scales = reinterpret_cast<float*>(ws + 3 * blocks + aligned(m * 4));
  const float* x = static_cast<const float*>(a.input.data);
  float* out = static_cast<float*>(a.output.data);
  float* ew = static_cast<float*>(a.worker_residual.data);
  float* es = static_cast<float*>(a.server_residual.data);
  auto mask_at = [mask](size_t i) { return mask ? mask + i : nullptr; };

  // 1. Worker: chunk j of x + e_w -> bits and scale (empty chunks: zero bits, scale 0).
  timeline::Phase phase("COMPRESS");
  ops.fill_zero(send, B * N);
  ops.fill_zero(scales, N * sizeof(float));
  for (int j = 0; j < size; ++j) {
    uint8_t* block = send + static_cast<size_t>(j) * B;
    const size_t b = L.begin(j), len = L.length(j);
    if (len) ops.onebit_compress(x + b, ew + b, len, m, block, scales + j, mask_at(b));
    ops.copy(block + bits, scales + j, sizeof(float));
  }

  // 2. All-to-all: rank j gets every rank's chunk j.
  phase.next("ALLTOALL");
  exchange(true, send, recv, B, comm, size, ops, w);

  // 3. Server: a = sum_k fl(w s_k) (2 bit - 1) in rank order, then compressed
  //    with the server residual into this rank's block (reusing send's first).
  phase.next("SERVER_REDUCE");
  const size_t myb = L.begin(rank), mylen = L.length(rank);
  uint8_t* mine = send;
  ops.fill_zero(mine, B);
  ops.fill_zero(scales, N * sizeof(float));
  if (mylen) {
    for (int k = 0; k < size; ++k) ops.copy(scales + k, recv + static_cast<size_t>(k) * B + bits, sizeof(float));
    ops.fill_zero(acc, mylen * sizeof(float));
    for (int k = 0; k < size; ++k)
      ops.onebit_decompress_accumulate(recv + static_cast<size_t>(k) * B, scales + k, mylen, m, acc, weight,
                                       mask_at(myb));
    ops.onebit_compress(acc, es, mylen, m, mine, scales, mask_at(myb));
  }
  ops.copy(mine + bits, scales, sizeof(float));

  // 4. Allgather of the server chunks; 5. every rank decompresses all of them.
  phase.next("ALLGATHER");
  exchange(false, mine, gathered, B, comm, size, ops, w);
  phase.next("DECOMPRESS");
  for (int j = 0; j < size; ++j) ops.copy(scales + j, gathered + static_cast<size_t>(j) * B + bits, sizeof(float));
  for (int j = 0; j < size; ++j) {
    const size_t b = L.begin(j), len = L.length(j);
    if (len) ops.onebit_decompress(gathered + static_cast<size_t>(j) * B, scales + j, len, m, out + b, mask_at(b));
  }
}

}  // namespace

void device_compressed_allreduce(const CompressedArgs& a, MPI_Comm comm, DeviceOps& ops, const DeviceWire& wire,
                                 CompressedStats* stats) {
  int rank = 0, size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size));
  const size_t n = a.input.count;
  stats->wire_bytes = compressed_wire_bytes(a.compression, n, size, rank);
  stats->fp32_ring_bytes = ring_wire_bytes(n, 4, size, rank);
  if (n == 0) return;
  if (a.compression == Compression::ONEBIT)
    device_onebit(a, comm, rank, size, ops, wire);
  else
    device_half(a, comm, size, ops, wire);
}

}  // namespace comm
}  // namespace pycomm
