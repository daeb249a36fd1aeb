// Compressed allreduce of tensors in device memory (compressed_allreduce.h
// gives the math; the flat form's and the hierarchical form's, step for step).
// Every kernel -- cast, sign packing, scales, error feedback, the server's
// sum -- runs on the tensor's memory through its DeviceOps table; only the
// compressed bytes cross MPI between nodes:
//   direct (CUDA-aware MPI): MPI reads and writes the device buffers;
//   staged: the compressed bytes go through the engine's pinned host chunks
//     (fp16/bf16: the double-buffered pipeline of staging.h, with the ring's
//     sums on the host; onebit: its all-to-all and allgather blocks, n/8 + 4N
//     bytes, one copy down and one up for each).
// The onebit scheme itself is the host form's (compressed_detail::onebit_two_phase,
// compressed_allreduce.cpp), run here with the tensor's table.
// Working memory comes from the tensor's MemoryMover: this call's buffers
// from its compressed_memory(), the ring's slots from its working_memory()
// (both cached, grown 2x, bounded by PYCOMM_DEVICE_CACHE_MB), so a steady
// stream of calls allocates nothing.
//
// Hierarchical form (device_hierarchical_compressed_allreduce), N = L M ranks
// as M nodes of L, n float32 elements (S = 4n bytes), local rank l owning
// slice l (about n/L elements, part_begin/part_size):
//   1. every rank checks its input for inf/NaN; agreed over the world
//      (one MPI_Allgather of an int);
//   2. node reduce-scatter, float32, uncompressed: local rank l ends with
//      slice l of the node's sum, added in the host window's order
//      (x_l + x_{l+1} + ... + x_{l-1}, local ranks mod L) --
//        direct: every local rank sends slice j of its input to local rank j
//          (L-1 messages in flight at once, device pointers) and adds what it
//          receives on the device in that order; sends (L-1)/L S;
//        staged: the input goes down to this rank's host window segment, the
//          host form's shm reduction sums it, slice l goes back up (S down,
//          S/L up; no MPI traffic);
//   3. across nodes, on slice l among the M ranks with local rank l (cross),
//      with the average's weight 1/N: the flat form's scheme, device kernels;
//      fp16/bf16 send 2 (M-1)/M * 2 n/L bytes, onebit 2 (M-1) (ceil(n/8N) + 4);
//      a node sum or cross-node sum out of range is agreed over the world
//      (MPI_Allreduce of an int) before any output or residual is written;
//   4. node allgather of the L slices into the output --
//        direct: MPI_Allgatherv on device pointers; sends S/L to each of L-1;
//        staged: slice l down into the window (S/L), every slice up (S).
// Bytes on the network per rank: step 3 only (the host form's), the node
// stages move over the node's own links (GPU peer links, or host memory).
#include <mpi.h>

#include <climits>
#include <cstring>
#include <vector>

#include "algorithms.h"
#include "compressed_allreduce.h"
#include "device_ops.h"
#include "shm_window.h"
#include "staging.h"
#include "timeline.h"

namespace pycomm {
namespace comm {
namespace shm_detail {  // shm_allreduce.cpp
uint64_t reduce_own_slice(size_t count, DType dtype, ReduceOp op, ShmWindow& shm);
}  // namespace shm_detail

namespace {

constexpr int kNodeTag = 0x4843;  // the hierarchical form's node reduce-scatter
using compressed_detail::ws_aligned;

// The ring over the half buffer `hb` among `comm`'s ranks, partial sums combined in fp32 on every
// hop: on the device (the mover's reduce) when direct, on the host chunks when staged.
void half_ring(const Buffer& hb, MPI_Comm comm, const DeviceWire& w) {
  if (w.direct) {
    ring_allreduce(hb, ReduceOp::SUM, comm, w.ring_chunk_bytes, &w.mover);
  } else {
    staged_allreduce(hb, hb, w.mover, w.staging, w.staging_chunk_bytes, [&](const Buffer& chunk) {
      ring_allreduce(chunk, ReduceOp::SUM, comm, w.ring_chunk_bytes);
    });
  }
}

size_t half_workspace_bytes(size_t n) { return ws_aligned(n * 2); }

void device_half(const CompressedArgs& a, MPI_Comm comm, int size, DeviceOps& ops, const DeviceWire& w) {
  const size_t n = a.input.count;
  const DType half = a.compression == Compression::BF16 ? DType::BF16 : DType::F16;
  MemoryMover::Lease ws = w.mover.compressed_memory(half_workspace_bytes(n));
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
  if (size > 1) half_ring(hb, comm, w);
  phase.next("DECOMPRESS");
  // Inputs were finite (checked above), so inf/NaN now is an overflow on the way (compressed_allreduce.cpp).
  if (half == DType::F16 && ops.any_nonfinite_half(h, n, half)) compressed_detail::throw_fp16_overflow(a);
  ops.cast_to_float(h, static_cast<float*>(a.output.data), n, half);
}

void device_onebit(const CompressedArgs& a, MPI_Comm comm, int size, DeviceOps& ops, const DeviceWire& w) {
  const size_t n = a.input.count;
  compressed_detail::agree_finite(
      ops.any_nonfinite(static_cast<const float*>(a.input.data), static_cast<const uint8_t*>(a.mask.data), n), comm,
      size, a, "inf or NaN");
  MemoryMover::Lease lease = w.mover.compressed_memory(compressed_detail::onebit_workspace_bytes(n, size));
  compressed_detail::onebit_two_phase(a, comm, a.average ? 1.0f / static_cast<float>(size) : 1.0f, ops,
                                      w.direct ? nullptr : &w, static_cast<uint8_t*>(lease.get()), nullptr);
}

// ---- the hierarchical form's node stages (schedule at the top) ----

// Direct, step 2: slice s.me of the node's float32 sum of `x` into `acc`, from the other local
// ranks' slices received into `slots` ((L-1) x len floats), added in the window's order.
void node_reduce_scatter_direct(const float* x, size_t n, float* acc, float* slots, MPI_Comm local,
                                const compressed_detail::NodeSlice& s, MemoryMover& mover) {
  const int L = s.L, me = s.me;
  const int len = static_cast<int>(s.len);
  std::vector<MPI_Request> recv(static_cast<size_t>(L - 1), MPI_REQUEST_NULL);
  std::vector<MPI_Request> send(static_cast<size_t>(L - 1), MPI_REQUEST_NULL);
  for (int k = 1; k < L; ++k)
    PYCOMM_MPI_CHECK(MPI_Irecv(slots + static_cast<size_t>(k - 1) * s.len, len, MPI_FLOAT, (me + k) % L, kNodeTag,
                               local, &recv[k - 1]));
  for (int k = 1; k < L; ++k) {
    const int to = (me - k + L) % L;  // receives from `me` as its k-th peer
    PYCOMM_MPI_CHECK(MPI_Isend(x + part_begin(n, L, to), static_cast<int>(part_size(n, L, to)), MPI_FLOAT, to,
                               kNodeTag, local, &send[k - 1]));
  }
  if (s.len) mover.copy(acc, x + s.begin, s.len * sizeof(float));
  for (int k = 1; k < L; ++k) {
    PYCOMM_MPI_CHECK(MPI_Wait(&recv[k - 1], MPI_STATUS_IGNORE));
    if (s.len) mover.reduce(acc, slots + static_cast<size_t>(k - 1) * s.len, s.len, DType::F32, ReduceOp::SUM);
  }
  PYCOMM_MPI_CHECK(MPI_Waitall(L - 1, send.data(), MPI_STATUSES_IGNORE));
}

// Direct, step 4: every local rank's slice (`acc`) into `out` on every local rank.
void node_allgather_direct(const float* acc, float* out, size_t n, MPI_Comm local, const compressed_detail::NodeSlice& s) {
  std::vector<int> counts(static_cast<size_t>(s.L)), displs(static_cast<size_t>(s.L));
  for (int j = 0; j < s.L; ++j) {
    counts[j] = static_cast<int>(part_size(n, s.L, j));
    displs[j] = static_cast<int>(part_begin(n, s.L, j));
  }
  PYCOMM_MPI_CHECK(MPI_Allgatherv(acc, counts[s.me], MPI_FLOAT, out, counts.data(), displs.data(), MPI_FLOAT, local));
}

// Staged: `bytes` between the tensor's memory and host memory that is not pinned (the window), in
// pinned chunks of at most staging_chunk_bytes, double-buffered on the mover's two lanes.
size_t staging_piece(size_t bytes, const DeviceWire& w) {
  const size_t piece = std::min(bytes, std::max<size_t>(w.staging_chunk_bytes, 1));
  w.staging.reserve(w.mover, piece);
  return piece;
}

void download(void* host, const void* src, size_t bytes, const DeviceWire& w) {
  if (!bytes) return;
  const size_t piece = staging_piece(bytes, w), pieces = (bytes + piece - 1) / piece;
  auto len = [&](size_t k) { return std::min(piece, bytes - k * piece); };
  w.mover.to_host_async(w.staging.chunk[0], src, len(0), 0);
  for (size_t k = 0; k < pieces; ++k) {
    const int lane = static_cast<int>(k % 2);
    w.mover.wait_lane(lane);
    if (k + 1 < pieces)  // the other chunk was copied out (below) one piece ago
      w.mover.to_host_async(w.staging.chunk[1 - lane], static_cast<const char*>(src) + (k + 1) * piece, len(k + 1),
                            1 - lane);
    std::memcpy(static_cast<char*>(host) + k * piece, w.staging.chunk[lane], len(k));
  }
}

void upload(void* dst, const void* host, size_t bytes, const DeviceWire& w) {
  if (!bytes) return;
  const size_t piece = staging_piece(bytes, w), pieces = (bytes + piece - 1) / piece;
  for (size_t k = 0; k < pieces; ++k) {
    const int lane = static_cast<int>(k % 2);
    const size_t len = std::min(piece, bytes - k * piece);
    w.mover.wait_lane(lane);  // this chunk's upload of piece k-2 has run
    std::memcpy(w.staging.chunk[lane], static_cast<const char*>(host) + k * piece, len);
    w.mover.to_device_async(static_cast<char*>(dst) + k * piece, w.staging.chunk[lane], len, lane);
  }
  w.mover.wait_lane(0);
  w.mover.wait_lane(1);
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
    device_onebit(a, comm, size, ops, wire);
  else
    device_half(a, comm, size, ops, wire);
}

void device_hierarchical_compressed_allreduce(const CompressedArgs& a, const Topology& topo, DeviceOps& ops,
                                              const DeviceWire& w, ShmWindow* shm, CompressedStats* stats) {
  const compressed_detail::NodeSlice s = compressed_detail::node_slice(a, topo, stats);
  const size_t n = a.input.count;
  if (n == 0) return;
  if (!w.direct && !shm) throw CommError("compressed allreduce: the staged hierarchical form needs the host window");
  // The node stages count elements in ints (checked before anything moves).
  if (w.direct && n > static_cast<size_t>(INT_MAX))
    throw CommError("compressed allreduce of '" + a.name + "' across nodes on device memory: " + std::to_string(n) +
                    " elements exceed MPI's int counts");
  const bool onebit = a.compression == Compression::ONEBIT;
  const DType half = a.compression == Compression::BF16 ? DType::BF16 : DType::F16;
  const float* x = static_cast<const float*>(a.input.data);
  float* out = static_cast<float*>(a.output.data);
  const uint8_t* mask = static_cast<const uint8_t*>(a.mask.data);

  // 1. Inputs, checked on every rank so that the error names the ranks that passed inf/NaN.
  compressed_detail::agree_finite(ops.any_nonfinite(x, mask, n), topo.world, topo.size, a, "inf or NaN");

  // Working memory: the slice's float32 sum (len), the direct node stage's receive slots ((L-1) len),
  // the cross-node stage's buffers.
  const size_t acc_bytes = ws_aligned(s.len * sizeof(float));
  const size_t slot_bytes = w.direct ? ws_aligned(static_cast<size_t>(s.L - 1) * s.len * sizeof(float)) : 0;
  const size_t cross_bytes =
      onebit ? compressed_detail::onebit_workspace_bytes(s.len, s.M) : half_workspace_bytes(s.len);
  MemoryMover::Lease lease = w.mover.compressed_memory(acc_bytes + slot_bytes + cross_bytes);
  uint8_t* ws = static_cast<uint8_t*>(lease.get());
  float* acc = reinterpret_cast<float*>(ws);
  uint8_t* cross_ws = ws + acc_bytes + slot_bytes;

  // 2. Slice s.me of the node's float32 sum, into acc.
  timeline::Phase phase("LOCAL_REDUCE_SCATTER");
  if (w.direct) {
    node_reduce_scatter_direct(x, n, acc, reinterpret_cast<float*>(ws + acc_bytes), topo.local, s, w.mover);
  } else {
    shm->reserve(n * sizeof(float));
    download(shm->mine(), x, n * sizeof(float), w);
    shm->fence();
    shm_detail::reduce_own_slice(n, DType::F32, ReduceOp::SUM, *shm);
    shm->fence();
    upload(acc, shm->mine() + s.begin * sizeof(float), s.len * sizeof(float), w);
  }

  // 3. The compressed scheme across nodes, on the slice, weighted 1/N for an average. Every rank
  //    learns whether any sum left its format's range before any output or residual is written.
  phase.next("CROSS_NODE");
  const float weight = a.average ? 1.0f / static_cast<float>(topo.size) : 1.0f;
  if (onebit) {
    const uint8_t* slice_mask = mask ? mask + s.begin : nullptr;
    if (compressed_detail::any_rank(s.len ? ops.any_nonfinite(acc, slice_mask, s.len) : 0, topo.world))
      compressed_detail::throw_node_sum_overflow(a);
    CompressedArgs c = a;
    c.input.data = c.output.data = acc;
    c.input.count = c.output.count = s.len;
    c.worker_residual.data = static_cast<float*>(a.worker_residual.data) + s.begin;
    c.worker_residual.count = s.len;
    c.server_residual.count = onebit_layout(s.len, s.M).chunk;  // a prefix of the flat layout's chunk
    c.mask.data = const_cast<uint8_t*>(slice_mask);
    compressed_detail::onebit_two_phase(c, topo.cross, weight, ops, w.direct ? nullptr : &w, cross_ws, nullptr);
  } else {
    int overflow = s.len ? ops.cast_to_half(acc, cross_ws, s.len, half, weight) : 0;  // pre-divided
    Buffer hb = a.input;
    hb.data = cross_ws;
    hb.count = s.len;
    hb.dtype = half;
    if (s.M > 1 && s.len) half_ring(hb, topo.cross, w);
    if (s.len) overflow |= ops.any_nonfinite_half(cross_ws, s.len, half);
    if (compressed_detail::any_rank(overflow, topo.world)) compressed_detail::throw_half_overflow(a, half);
    if (s.len) ops.cast_to_float(cross_ws, acc, s.len, half);
  }

  // 4. Every slice into every local rank's output.
  phase.next("LOCAL_ALLGATHER");
  if (w.direct) {
    node_allgather_direct(acc, out, n, topo.local, s);
  } else {
    download(shm->mine() + s.begin * sizeof(float), acc, s.len * sizeof(float), w);
    shm->fence();
    for (int k = 0; k < s.L; ++k) {
      const int owner = (s.me + k) % s.L;
      const size_t b = part_begin(n, s.L, owner);
      upload(out + b, shm->segment(owner) + b * sizeof(float), part_size(n, s.L, owner) * sizeof(float), w);
    }
    shm->fence();  // nobody overwrites a segment that a peer still reads
  }
}

}  // namespace comm
}  // namespace pycomm
