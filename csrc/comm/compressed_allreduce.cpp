// Compressed allreduce: fp16/bf16 and the two-phase 1-bit scheme (see the header).
// The engine runs these schemes from Executor::compressed_allreduce (executor_ops.cpp).
#include "compressed_allreduce.h"

#include <cfloat>
#include <cmath>
#include <cstring>
#include <sstream>
#include <vector>

#include "../kernels/cast.h"
#include "../kernels/cpu_dispatch.h"
#include "../kernels/onebit.h"
#include "algorithms.h"
#include "device_ops.h"
#include "staging.h"
#include "timeline.h"

namespace pycomm {
namespace comm {
const std::vector<CompressionEntry>& compression_table() {
  static const std::vector<CompressionEntry> table = {
      {Compression::FP16, "fp16"},
      {Compression::BF16, "bf16"},
      {Compression::ONEBIT, "onebit"},
  };
  return table;
}

const char* compression_name(Compression c) {
  for (const auto& e : compression_table())
    if (e.id == c) return e.name;
  return "unknown";
}

bool compression_from_name(const std::string& name, Compression* out) {
  for (const auto& e : compression_table())
    if (name == e.name) {
      *out = e.id;
      return true;
    }
  return false;
}

std::string compression_choices() {
  std::string s;
  const auto& t = compression_table();
  for (size_t i = 0; i < t.size(); ++i) s += (i == 0 ? "" : i + 1 == t.size() ? " or " : ", ") + std::string(t[i].name);
  return s;
}

OneBitLayout onebit_layout(size_t n, int world) {
  OneBitLayout l;
  l.n = n;
  l.world = world;
  const size_t unit = 8 * static_cast<size_t>(world);
  l.padded = (n + unit - 1) / unit * unit;
  l.chunk = l.padded / static_cast<size_t>(world);
  return l;
}

uint64_t ring_wire_bytes(size_t n, size_t esize, int world, int rank) {
  if (world <= 1) return 0;
  uint64_t total = 0;
  for (int t = 0; t < 2 * (world - 1); ++t) {  // step t sends segment (rank - t) mod N (ring_allreduce.cpp)
    int seg = ((rank - t) % world + world) % world;
    total += part_size(n, world, seg) * esize;
  }
  return total;
}

uint64_t compressed_wire_bytes(Compression c, size_t n, int world, int rank) {
  if (world <= 1 || n == 0) return 0;
  if (c == Compression::ONEBIT) {
    // all-to-all: one block to each other rank; allgather: this rank's block
    // reaches each other rank once.
    return 2ull * static_cast<uint64_t>(world - 1) * onebit_layout(n, world).block_bytes();
  }
  return ring_wire_bytes(n, 2, world, rank);
}

namespace compressed_detail {

// Every rank learns which ranks flagged non-finite input; all of them throw
// the same error when any did, before anything has been written.
void agree_finite(int bad, MPI_Comm comm, int size, const CompressedArgs& a, const char* detail) {
  std::vector<int> flags(static_cast<size_t>(size), bad);
  if (size > 1) PYCOMM_MPI_CHECK(MPI_Allgather(&bad, 1, MPI_INT, flags.data(), 1, MPI_INT, comm));
  std::vector<int> ranks;
  for (int r = 0; r < size; ++r)
    if (flags[r]) ranks.push_back(r);
  if (ranks.empty()) return;
  std::ostringstream msg;
  msg << "pycomm.allreduce(compression='" << compression_name(a.compression) << "')";
  if (!a.name.empty()) msg << " of '" << a.name << "'";
  msg << ": " << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) msg << (i ? "," : "") << ranks[i];
  msg << " passed a tensor with " << detail
      << "; nothing was reduced and no output or residual was changed. Find where the value comes from "
         "(for example a diverging loss), or skip this step.";
  throw CommError(msg.str());
}

[[noreturn]] void throw_fp16_overflow(const CompressedArgs& a) {
  throw CommError(std::string("pycomm.allreduce(compression='fp16', op='") + (a.average ? "avg" : "sum") + "')" +
                  (a.name.empty() ? std::string() : " of '" + a.name + "'") +
                  (a.average ? ": the average, or a partial sum on the way to it, overflowed float16 (beyond "
                               "65504); nothing was written. Use compression='bf16' (float32's range)."
                             : ": the sum overflowed float16; nothing was written. Use op='avg' (pre-divides by "
                               "the number of ranks) or compression='bf16'."));
}

const char* half_input_problem(DType half, bool average) {
  return half == DType::F16 && average ? "inf or NaN, or a value beyond the float16 range even after the "
                                         "division by the number of ranks (use compression='bf16')"
         : half == DType::F16 ? "inf or NaN, or a value beyond the float16 range (op='avg' divides by the "
                                "number of ranks first; compression='bf16' has float32's range)"
                              : "inf or NaN";
}

int any_rank(int flag, MPI_Comm comm) {
  int any = flag;
  PYCOMM_MPI_CHECK(MPI_Allreduce(&flag, &any, 1, MPI_INT, MPI_MAX, comm));
  return any;
}

void throw_node_sum_overflow(const CompressedArgs& a) {
  throw CommError("pycomm.allreduce(compression='onebit')" + (a.name.empty() ? std::string() : " of '" + a.name + "'") +
                  ": the sum of a node's inputs overflowed float32; nothing was reduced and no output or "
                  "residual was changed.");
}

void throw_half_overflow(const CompressedArgs& a, DType half) {
  if (half == DType::F16) throw_fp16_overflow(a);
  throw CommError("pycomm.allreduce(compression='bf16')" + (a.name.empty() ? std::string() : " of '" + a.name + "'") +
                  ": the sum overflowed bfloat16; nothing was written.");
}

NodeSlice node_slice(const CompressedArgs& a, const Topology& topo, CompressedStats* stats) {
  NodeSlice s;
  s.L = topo.local_size;
  s.me = topo.local_rank;
  PYCOMM_MPI_CHECK(MPI_Comm_size(topo.cross, &s.M));
  PYCOMM_MPI_CHECK(MPI_Comm_rank(topo.cross, &s.cross_rank));
  const size_t n = a.input.count;
  s.begin = part_begin(n, s.L, s.me);
  s.len = part_size(n, s.L, s.me);
  stats->wire_bytes = compressed_wire_bytes(a.compression, s.len, s.M, s.cross_rank);
  stats->fp32_ring_bytes = ring_wire_bytes(n, 4, topo.size, topo.rank);
  return s;
}

}  // namespace compressed_detail
using compressed_detail::agree_finite;
using compressed_detail::any_rank;
using compressed_detail::throw_fp16_overflow;

namespace {

void check_int(size_t bytes, const char* what) {
  if (bytes > static_cast<size_t>(INT32_MAX))
    throw CommError(std::string("compressed allreduce: ") + what + " is larger than 2 GiB per rank");
}

}  // namespace

namespace compressed_detail {

// 1 if any kept element of x is inf or NaN.
int has_nonfinite(const float* x, const uint8_t* mask, size_t n) {
  int bad = 0;
  const int threads = kernels::threads_for(n * sizeof(float));
#pragma omp parallel for reduction(| : bad) schedule(static) num_threads(threads) if (threads > 1)
  for (size_t i = 0; i < n; ++i) bad |= (!(std::fabs(x[i]) <= FLT_MAX) && (!mask || mask[i])) ? 1 : 0;
  return bad;
}

// 1 if any element of the half buffer is inf or NaN (exponent all ones, for fp16 and bf16 alike).
int half_has_nonfinite(const void* h, size_t n, DType half) {
  const uint16_t* v = static_cast<const uint16_t*>(h);
  const uint16_t exp = half == DType::F16 ? 0x7c00u : 0x7f80u;
  for (size_t i = 0; i < n; ++i)
    if ((v[i] & exp) == exp) return 1;
  return 0;
}

}  // namespace compressed_detail

using compressed_detail::half_has_nonfinite;
using compressed_detail::has_nonfinite;

void half_compressed_allreduce(const CompressedArgs& a, MPI_Comm comm, size_t ring_chunk_bytes, MemoryMover& memory,
                               CompressedStats* stats) {
  int rank = 0, size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size));
  const size_t n = a.input.count;
  const DType half = a.compression == Compression::BF16 ? DType::BF16 : DType::F16;
  const float* x = static_cast<const float*>(a.input.data);
  float* out = static_cast<float*>(a.output.data);
  stats->wire_bytes = compressed_wire_bytes(a.compression, n, size, rank);
  stats->fp32_ring_bytes = ring_wire_bytes(n, 4, size, rank);
  if (n == 0) return;

  MemoryMover::Lease lease = memory.compressed_memory(n * 2);
  void* h = lease.get();
  // Pre-divided cast: y = half(x / N) for an average.
  const float scale = a.average ? 1.0f / static_cast<float>(size) : 1.0f;
  int bad = 0;
  timeline::Phase phase("COMPRESS");
  kernels::cast_to_half_cpu(x, h, n, half, scale, &bad);
  agree_finite(bad, comm, size, a, compressed_detail::half_input_problem(half, a.average));
  Buffer hb;
  hb.data = h;
  hb.count = n;
  hb.dtype = half;
  // Partial sums are combined in fp32 on every hop (reduce_cpu widens, adds, rounds once).
  phase.next("RING");
  ring_allreduce(hb, ReduceOp::SUM, comm, ring_chunk_bytes);
  phase.next("DECOMPRESS");
  if (half == DType::F16) {
    // A sum can overflow float16 on the way even when every input fits; so can
    // an average: its pre-divided terms fit, but the mean may not, and with
    // mixed signs a partial sum may overflow although the mean fits. The
    // input had no inf/NaN (checked above), so inf/NaN now is an overflow. The
    // reduced buffer is the same on every rank, so every rank sees this.
    if (half_has_nonfinite(h, n, half)) throw_fp16_overflow(a);
  }
  kernels::cast_to_float_cpu(h, out, n, half, 1.0f);
}

namespace compressed_detail {
namespace {

// MPI_Alltoall (each rank sends `block` bytes to every rank) or MPI_Allgather (each rank's one
// block to all) between two buffers of `ops`'s memory; through the pinned chunks when staged.
void exchange(bool alltoall, const void* send, void* recv, size_t block, MPI_Comm comm, int size, DeviceOps& ops,
              const DeviceWire* staged) {
  const int b = static_cast<int>(block);
  if (size == 1) {
    ops.copy(recv, send, block);
    return;
  }
  const size_t send_bytes = alltoall ? block * static_cast<size_t>(size) : block;
  const size_t recv_bytes = block * static_cast<size_t>(size);
  const void* s = send;
  void* r = recv;
  if (staged) {  // down to the pinned host chunks, MPI there, back up
    staged->staging.reserve(staged->mover, recv_bytes);
    staged->mover.to_host_async(staged->staging.chunk[0], send, send_bytes, 0);
    staged->mover.wait_lane(0);
    s = staged->staging.chunk[0];
    r = staged->staging.chunk[1];
  }
  if (alltoall)
    PYCOMM_MPI_CHECK(MPI_Alltoall(s, b, MPI_BYTE, r, b, MPI_BYTE, comm));
  else
    PYCOMM_MPI_CHECK(MPI_Allgather(s, b, MPI_BYTE, r, b, MPI_BYTE, comm));
  if (staged) {
    staged->mover.to_device_async(recv, staged->staging.chunk[1], recv_bytes, 0);
    staged->mover.wait_lane(0);
  }
}

}  // namespace

// Send, recv and gathered blocks (B N bytes each; bits then an unaligned scale, the wire
// format), the server's float32 sum (m), and the scales as aligned floats for the kernels (N).
size_t onebit_workspace_bytes(size_t n, int size) {
  const OneBitLayout L = onebit_layout(n, size);
  const size_t N = static_cast<size_t>(size);
  return 3 * ws_aligned(L.block_bytes() * N) + ws_aligned(L.chunk * 4) + ws_aligned(N * 4);
}

void onebit_two_phase(const CompressedArgs& a, MPI_Comm comm, float weight, DeviceOps& ops, const DeviceWire* staged,
                      uint8_t* ws, uint8_t* gathered_into) {
  int rank = 0, size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size));
  const size_t n = a.input.count;
  if (n == 0) return;
  const uint8_t* mask = static_cast<const uint8_t*>(a.mask.data);
  const OneBitLayout L = onebit_layout(n, size);
  const size_t B = L.block_bytes(), bits = L.bit_bytes(), m = L.chunk, N = static_cast<size_t>(size);
  check_int(B, "a 1-bit chunk");

  const size_t blocks = ws_aligned(B * N);
  uint8_t* send = ws;
  uint8_t* recv = ws + blocks;
  uint8_t* gathered = gathered_into ? gathered_into : ws + 2 * blocks;
  float* acc = reinterpret_cast<float*>(ws + 3 * blocks);
  float* scales = reinterpret_cast<float*>(ws + 3 * blocks + ws_aligned(m * 4));
  const float* x = static_cast<const float*>(a.input.data);
  float* out = static_cast<float*>(a.output.data);
  float* ew = static_cast<float*>(a.worker_residual.data);
  float* es = static_cast<float*>(a.server_residual.data);
  auto mask_at = [mask](size_t i) { return mask ? mask + i : nullptr; };

  // 1. Worker: chunk j of x + e_w -> bits and scale, straight into the block for rank j
  //    (empty chunks: zero bits, scale 0).
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
  exchange(true, send, recv, B, comm, size, ops, staged);

  // 3. Server: a = sum_k fl(w s_k) (2 bit - 1) in rank order, w = 1/N (avg) or 1 (sum); then
  //    compressed with the server residual into this rank's block (send's first, free again).
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
  exchange(false, mine, gathered, B, comm, size, ops, staged);
  if (gathered_into) return;
  phase.next("DECOMPRESS");
  for (int j = 0; j < size; ++j) ops.copy(scales + j, gathered + static_cast<size_t>(j) * B + bits, sizeof(float));
  for (int j = 0; j < size; ++j) {
    const size_t b = L.begin(j), len = L.length(j);
    if (len) ops.onebit_decompress(gathered + static_cast<size_t>(j) * B, scales + j, len, m, out + b, mask_at(b));
  }
}

}  // namespace compressed_detail

void onebit_compressed_allreduce(const CompressedArgs& a, MPI_Comm comm, MemoryMover& memory,
                                 CompressedStats* stats) {
  int rank = 0, size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size));
  const size_t n = a.input.count;
  stats->wire_bytes = compressed_wire_bytes(Compression::ONEBIT, n, size, rank);
  stats->fp32_ring_bytes = ring_wire_bytes(n, 4, size, rank);
  if (n == 0) return;
  agree_finite(has_nonfinite(static_cast<const float*>(a.input.data), static_cast<const uint8_t*>(a.mask.data), n),
               comm, size, a, "inf or NaN");
  MemoryMover::Lease lease = memory.compressed_memory(compressed_detail::onebit_workspace_bytes(n, size));
  uint8_t* ws = static_cast<uint8_t*>(lease.get());
  compressed_detail::onebit_two_phase(a, comm, a.average ? 1.0f / static_cast<float>(size) : 1.0f, cpu_device_ops(),
                                      nullptr, ws, nullptr);
}

}  // namespace comm
}  // namespace pycomm
