// Compressed allreduce of float32 buffers (docs/algorithms.md §2).
//
// fp16 / bf16: every rank casts its buffer to half precision with the 1/N of
// an average applied before the cast (a sum of N values near the top of the
// fp16 range overflows before a later division could help), a ring allreduce
// sums the half buffer combining the partial sums in fp32 on every hop (one
// rounding per hop), and the result is cast back to float32.
//
// onebit: the two-phase scheme of DeepSpeed's compressed allreduce, with error
// feedback on both sides. With n elements and N ranks, n is padded to
// n_pad = ceil(n / 8N) * 8N and cut into N chunks of m = n_pad / N elements
// (a whole number of bytes of sign bits); chunk j covers elements
// [j m, min((j+1) m, n)), so trailing chunks may be short or empty and no
// padding element ever enters a scale.
//   1. worker: c = x + e_w per chunk; s_j = ||c_j||_2 / sqrt(len_j);
//      bit_i = (c_i >= 0); e_w <- c - s_j (2 bit - 1).
//   2. all-to-all: rank j receives every rank's sign bits and scale of chunk j.
//   3. server (rank j): a = (1/N) sum_k s_kj (2 bit_k - 1) (sum for op=sum),
//      in rank order; then compresses a with its server residual e_s exactly
//      as in 1 (one scale for its chunk).
//   4. allgather of the server chunks (bits + scale); every rank decompresses
//      all N chunks, so every rank holds bitwise the same result.
// A mask (uint8, 1 = keep) forces the masked-out elements to exactly zero in
// the result and keeps their residuals at zero.
//
// Wire bytes, per rank: 2 (N-1) (m/8 + 4) for onebit, against
// 2 (N-1)/N * 4n for a float32 ring: about 1/32 of it (2 S/32 instead of 2 S,
// docs/algorithms.md §2). fp16/bf16 send exactly half of the float32 ring.
#pragma once
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include <string>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {

enum class Compression : int32_t { FP16 = 1, BF16 = 2, ONEBIT = 3 };

// The engine's compressions, one row each: the bindings, the c10d backend and (through
// _C.engine_compressions) pycomm.collectives.COMPRESSIONS all read this table. "none" is no row: it is
// the uncompressed allreduce.
struct CompressionEntry {
  Compression id;
  const char* name;
};
const std::vector<CompressionEntry>& compression_table();
const char* compression_name(Compression c);
// The row named `name`; false if the engine has no such compression.
bool compression_from_name(const std::string& name, Compression* out);
// "fp16, bf16 or onebit": the table's names, for error messages.
std::string compression_choices();

// What one compressed allreduce reports once it is done.
struct CompressedStats {
  uint64_t wire_bytes = 0;  // bytes this rank sent to other ranks
  uint64_t fp32_ring_bytes = 0;  // what an uncompressed float32 ring allreduce would have sent
};

struct CompressedArgs {
  Buffer input;   // float32, contiguous; host or device memory (then every buffer here on that device)
  Buffer output;  // float32, same count; == input for in place
  Compression compression = Compression::FP16;
  bool average = true;  // op=avg; false: op=sum
  // onebit only (CompressedArgs::onebit_layout gives the sizes):
  Buffer worker_residual;  // float32[n], updated in place
  Buffer server_residual;  // float32[m], updated in place (this rank's chunk)
  Buffer mask;             // one byte per element (1 keeps, 0 forces zero; dtype not read), or data == nullptr
  std::string name;
  std::shared_ptr<CompressedStats> stats;  // filled on completion when set
};

// The chunking of the onebit scheme for n elements over `world` ranks.
struct OneBitLayout {
  size_t n = 0, padded = 0, chunk = 0;  // chunk = m, a multiple of 8 (0 when n == 0)
  int world = 1;
  size_t begin(int j) const { return std::min(n, static_cast<size_t>(j) * chunk); }
  size_t length(int j) const { return std::min(n, begin(j) + chunk) - begin(j); }
  size_t bit_bytes() const { return chunk / 8; }
  size_t block_bytes() const { return bit_bytes() + sizeof(float); }  // one chunk on the wire: bits, then scale
};
OneBitLayout onebit_layout(size_t n, int world);

// Exact bytes `rank` sends in one call (0 when world == 1).
uint64_t compressed_wire_bytes(Compression c, size_t n, int world, int rank);
// Bytes `rank` sends in pycomm's ring allreduce of n elements of `esize` bytes.
uint64_t ring_wire_bytes(size_t n, size_t esize, int world, int rank);

// The algorithms; they run on the engine's thread. They throw CommError on
// every rank, before anything is written to the output or the residuals, when
// any rank's input holds inf or NaN (or, for fp16, a value that overflows
// after the pre-division), naming those ranks. Their working memory (the half
// buffer, onebit's wire buffers and sums) is `memory`'s compressed_memory(),
// the host mover's cache (memory_mover.h), kept between calls.
class MemoryMover;
void half_compressed_allreduce(const CompressedArgs& args, MPI_Comm comm, size_t ring_chunk_bytes, MemoryMover& memory,
                               CompressedStats* stats);
void onebit_compressed_allreduce(const CompressedArgs& args, MPI_Comm comm, MemoryMover& memory,
                                 CompressedStats* stats);

// Across nodes (the engine's choice when the job spans nodes of equal size
// with more than one rank each), only the cross-node stage is compressed: the
// node's L ranks sum in float32 through the shm window, local rank l owning
// slice l (about n/L elements); the compressed scheme above runs on slice l
// among the M ranks with local rank l (the cross communicator), weighted 1/N
// (N = L M ranks) for an average; the node's ranks take the result out of the
// window. fp16/bf16 run it chunk by chunk, the cross-node exchange of one
// chunk on the link while the node sums the next; onebit sums the node chunk
// by chunk, then runs its scheme on the whole slice (its scales are per slice).
// Schedule and bytes: hierarchical_compressed_allreduce.cpp. Inf/NaN in any
// input, and an overflow of a node sum or a half sum anywhere, are agreed over
// the world before any output or residual is written.
// Bytes a rank sends across nodes: fp16/bf16 about 2 (M-1)/M * 2 n/L; onebit
// 2 (M-1) (ceil(n/8N) + 4) -- against 2 (M-1)/M * 4 n/L for the uncompressed
// hierarchical allreduce. The residuals keep the flat form's shapes (worker n,
// server ceil(n/8N)*8): local rank l uses the worker residual of its slice,
// and a prefix of the server residual (ceil(ceil(n/L)/8M) = ceil(n/8N), so it fits).
// CompressedStats::wire_bytes counts the cross-node bytes. shm_chunk_bytes:
// the float32 bytes of one chunk of the node's L slices (0: one chunk).
class ShmWindow;
void hierarchical_compressed_allreduce(const CompressedArgs& args, const Topology& topo, ShmWindow& shm,
                                       size_t shm_chunk_bytes, MemoryMover& memory, CompressedStats* stats);

// The same on tensors in device memory (device_compressed_allreduce.cpp): the
// flat form over `comm`, every kernel on the tensor's memory through `ops`,
// only compressed bytes crossing MPI, bitwise the host form's result when
// `ops` runs the CPU kernels (host stand-ins) and, for fp16/bf16 staged, the
// half buffer fits one staging chunk (more chunks run one ring per chunk:
// the same sums, added in another order on some elements). Working memory:
// the tensor's mover's compressed_memory().
struct StagingBuffers;
class DeviceOps;
struct DeviceWire {
  MemoryMover& mover;        // the tensor's memory: the ring's slots and reductions, copies to staging
  bool direct;               // true: device pointers to MPI (CUDA-aware); false: through `staging`
  StagingBuffers& staging;   // the engine's pinned host chunks
  size_t staging_chunk_bytes;
  size_t ring_chunk_bytes;
};
void device_compressed_allreduce(const CompressedArgs& args, MPI_Comm comm, DeviceOps& ops, const DeviceWire& wire,
                                 CompressedStats* stats);

// The hierarchical form on device memory, where the host form runs it (nodes of
// equal size with several ranks each): the node's float32 sum uncompressed, the
// wire format (device kernels) only across nodes, the same slices, weights,
// residual shapes, checks and cross-node bytes (fp16/bf16: up to the rounding
// of the host form's per-chunk rings) as hierarchical_compressed_allreduce,
// whose result it equals bitwise when `ops` runs the CPU kernels (fp16/bf16:
// with two nodes, where each cross-node sum is one commutative addition; with
// more, when the slice's half buffer fits one staging chunk and the host form
// runs in one chunk, S <= shm_chunk_bytes). The node stages:
//   direct (wire.direct, CUDA-aware MPI): point-to-point on device buffers over
//     topo.local, reductions on the device (the mover's reduce);
//   staged: through the host window `shm` (the host form's float32 sum), the
//     tensor moved down and the result up in pinned staging chunks.
// The schedule and bytes are in device_compressed_allreduce.cpp.
void device_hierarchical_compressed_allreduce(const CompressedArgs& args, const Topology& topo, DeviceOps& ops,
                                              const DeviceWire& wire, ShmWindow* shm, CompressedStats* stats);

namespace compressed_detail {  // shared by the host and device forms (compressed_allreduce.cpp)
// Every rank learns which ranks flagged bad input; all throw the same CommError if any did.
void agree_finite(int bad, MPI_Comm comm, int size, const CompressedArgs& a, const char* detail);
[[noreturn]] void throw_fp16_overflow(const CompressedArgs& a);
// What a flagged input of a half cast means, for agree_finite.
const char* half_input_problem(DType half, bool average);
// The same flag on every rank of `comm`: any rank's.
int any_rank(int flag, MPI_Comm comm);
// The hierarchical forms' errors once the node sums are made: a onebit node sum
// beyond float32, a half cross-node sum beyond its range (nothing written).
[[noreturn]] void throw_node_sum_overflow(const CompressedArgs& a);
[[noreturn]] void throw_half_overflow(const CompressedArgs& a, DType half);
// This rank's part in the hierarchical form: local rank `me` of L owns slice
// [begin, begin + len) of the n elements (part_begin / part_size), reduced
// among the M ranks of its cross communicator, where it is `cross_rank`. Also
// fills the call's wire bytes (the cross-node bytes).
struct NodeSlice {
  int L = 1, me = 0, M = 1, cross_rank = 0;
  size_t begin = 0, len = 0;
};
NodeSlice node_slice(const CompressedArgs& a, const Topology& topo, CompressedStats* stats);
// 1 if any kept element of x (mask: 1 keeps; nullptr keeps all) is inf or NaN.
int has_nonfinite(const float* x, const uint8_t* mask, size_t n);
// 1 if any element of the half buffer is inf or NaN.
int half_has_nonfinite(const void* h, size_t n, DType half);
// Working memory is laid out in blocks of 256 bytes (device kernels want aligned floats).
inline size_t ws_aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }
// The onebit scheme's steps 1-5 over `comm` with the server weight (1/N for an
// average, 1 for a sum), on finite input: one schedule for every memory. The
// kernels run through `ops` (the tensor's memory); the all-to-all and the
// allgather hand MPI the buffers themselves when `staged` is null (host memory,
// or a CUDA-aware MPI) and go through its pinned host chunks otherwise. `ws`
// holds onebit_workspace_bytes(n, size) bytes of `ops`'s memory. With
// gathered_into (the same memory), step 4's allgather (size blocks) lands
// there and step 5 is the caller's (a.output is not written).
size_t onebit_workspace_bytes(size_t n, int size);
void onebit_two_phase(const CompressedArgs& a, MPI_Comm comm, float weight, DeviceOps& ops, const DeviceWire* staged,
                      uint8_t* ws, uint8_t* gathered_into);
}  // namespace compressed_detail

}  // namespace comm
}  // namespace pycomm
