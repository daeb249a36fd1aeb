// Hierarchical compressed allreduce (host memory): the node's float32 sum
// through the shm window, the wire format (fp16/bf16/onebit, the math of
// compressed_allreduce.h) only across nodes.
//
// N = L M ranks as M nodes of L; n float32 elements, S = 4n bytes. Local rank l
// owns slice l: [b_l, b_l + len_l) = part_begin/part_size(n, L, l), about n/L.
// The slices are cut into pieces of k elements, k = shm_chunk_bytes / 4L (a
// whole number of cache lines; k = len_0, one chunk, when shm_chunk_bytes is 0
// or S fits in it). Chunk t is piece t of every slice, elements
// [b_l + t k, b_l + min((t+1) k, len_l)), so T = ceil(len_0 / k) chunks, the
// last one short. The window holds two slots of L pieces (float32, one chunk
// each: shm_chunk_bytes, cache-sized) and, per rank, the result of its slice.
//
// Node stage of chunk t (both forms), one fence per chunk:
//   copy-in: piece t of every other rank's slice from this rank's input into
//     slot t%2 of its segment (checked for inf/NaN while in cache);
//   fence: chunk t is in every segment; every rank has read slot t%2's
//     previous chunk (t-2) before it reached this fence;
//   sum: own piece = x[piece] + seg(l+1)[piece] + ... + seg(l-1)[piece] (local
//     ranks mod L), the order of the unchunked form, into a cache-sized buffer.
// Per rank: reads S (input) + (L-1)/L S (peers' slots, from cache); writes
// (L-1)/L S into its slots (cache) and the sum, S/L.
//
// fp16/bf16 -- chunk by chunk, the link busy while the node works:
//   t: node stage of chunk t; cast the sum to half, pre-divided by N for an
//      average, into the slice's half buffer in the window (2 len_l bytes);
//      start the ring allreduce of that half piece among the M ranks of the
//      cross communicator (nonblocking: MPI_Isend/Irecv, one message per ring
//      step, advanced by MPI_Test between the node's copies and sums; up to
//      kInFlight chunks on the wire at once), then go on with chunk t+1.
//   end: wait for the rings; inf/NaN in any input is agreed over the world
//      (naming the ranks), then an overflow of any half cast or half sum; only
//      then fence and every rank casts the L half slices out of the window
//      into its output (read S/2, write S: the cast back and the copy out in
//      one pass); fence. The output is written only after both agreements, so
//      the copy-out cannot overlap the link; everything before it can.
//   Math: the node sums and the casts are the unchunked form's, element by
//   element. With M = 2 nodes a cross-node sum is one float32 addition of
//   two halves rounded once, whatever the chunking: the result is bitwise
//   the unchunked form's. With M > 2 the ring's M segments are those of each
//   piece, not of the whole slice, so an element's M-1 additions run in
//   another rotation of the rank order than unchunked (the same bound, one
//   rounding per hop; the result depends on shm_chunk_bytes).
//   Bytes across nodes per rank: the sum over chunks of a half ring of the
//   piece, 2 (M-1)/M * 2 len_l (exact: ring_wire_bytes per piece).
//
// onebit -- its scales are per chunk of the whole slice (onebit_layout(len_l,
//   M)), so its scheme is not pipelined: the node stage runs chunk by chunk
//   into the slice's float32 sum (private, S/L), each piece checked for a node
//   sum beyond float32 while in cache; inf/NaN input and node overflow are
//   agreed over the world; the two-phase scheme runs on the slice among the
//   cross ranks (residual updates, all-to-all, server, allgather), its
//   allgather landing in this rank's window segment (M blocks of
//   ceil(len_l/8M) + 4 bytes); fence; every rank decompresses the L slices'
//   blocks straight into its output (write S; the bits and scales decompressed
//   into the window and copied out before give bitwise the same values); fence.
//   Bytes across nodes: 2 (M-1) (ceil(len_l/8M) + 4) per rank, as before.
#include <algorithm>
#include <cstring>
#include <deque>
#include <vector>

#include "../kernels/cast.h"
#include "../kernels/onebit.h"
#include "../kernels/reduce.h"
#include "algorithms.h"
#include "compressed_allreduce.h"
#include "device_ops.h"
#include "memory_mover.h"
#include "shm_window.h"
#include "timeline.h"
#include "wait_policy.h"

namespace pycomm {
namespace comm {
namespace {

constexpr int kCrossTag = 0x4850;  // + ring index mod kTags
constexpr int kInFlight = 3;        // chunks whose cross-node rings may be on the wire at once
constexpr int kTags = 2 * kInFlight;  // ring t and t + kTags are never in flight together, on any rank

int checked_count(size_t bytes) {
  if (bytes > static_cast<size_t>(INT32_MAX))
    throw CommError("hierarchical compressed allreduce: a message larger than 2 GiB per rank");
  return static_cast<int>(bytes);
}

// One ring allreduce (sum) of a half buffer, in place, over `comm`: the
// schedule of RingPass (ring_allreduce.cpp) with one message per step -- step
// t in [0, 2(M-1)) sends segment (r - t) mod M to the right, receives segment
// (r - t - 1) mod M from the left and, below M-1, adds it (reduce_cpu: widened
// to float32, one rounding). Posted by the constructor, advanced by progress()
// without blocking, or to the end by finish().
class HalfRing {
 public:
  HalfRing(void* data, size_t count, DType half, MPI_Comm comm, int tag)
      : data_(static_cast<char*>(data)), count_(count), half_(half), comm_(comm), tag_(tag) {
    PYCOMM_MPI_CHECK(MPI_Comm_rank(comm, &rank_));
    PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size_));
    steps_ = 2 * (size_ - 1);
    left_ = (rank_ - 1 + size_) % size_;
    right_ = (rank_ + 1) % size_;
    sends_.assign(static_cast<size_t>(std::max(steps_, 0)), MPI_REQUEST_NULL);
    tmp_.resize(part_size(count, size_, 0) * 2);
    if (steps_ > 0) post_send(0);
  }
  HalfRing(const HalfRing&) = delete;
  HalfRing& operator=(const HalfRing&) = delete;

  // True once every step is done and every send has left.
  bool progress() {
    while (step_ < steps_) {
      if (!recv_posted_ && !post_recv(step_)) return false;
      int flag = 0;
      PYCOMM_MPI_CHECK(MPI_Test(&recv_, &flag, MPI_STATUS_IGNORE));
      if (!flag) return false;
      advance();
    }
    int flag = 0;
    PYCOMM_MPI_CHECK(MPI_Testall(static_cast<int>(sends_.size()), sends_.data(), &flag, MPI_STATUSES_IGNORE));
    return flag != 0;
  }

  void finish() {
    while (step_ < steps_) {
      if (!recv_posted_) {
        // An allgather step receives into a segment that an earlier send may still read.
        wait_sends_of(recv_seg(step_));
        post_recv(step_);
      }
      wait_request(&recv_);  // gives up the core under contention (wait_policy.h)
      advance();
    }
    wait_requests(static_cast<int>(sends_.size()), sends_.data());
  }

 private:
  int send_seg(int t) const { return ((rank_ - t) % size_ + size_) % size_; }
  int recv_seg(int t) const { return ((rank_ - t - 1) % size_ + size_) % size_; }
  char* seg_ptr(int seg) const { return data_ + part_begin(count_, size_, seg) * 2; }
  size_t seg_len(int seg) const { return part_size(count_, size_, seg); }

  void post_send(int t) {
    const int seg = send_seg(t);
    PYCOMM_MPI_CHECK(MPI_Isend(seg_ptr(seg), checked_count(seg_len(seg) * 2), MPI_BYTE, right_, tag_, comm_,
                               &sends_[static_cast<size_t>(t)]));
  }

  bool sends_of_done(int seg) {
    for (int s = 0; s < step_; ++s) {
      if (send_seg(s) != seg || sends_[static_cast<size_t>(s)] == MPI_REQUEST_NULL) continue;
      int flag = 0;
      PYCOMM_MPI_CHECK(MPI_Test(&sends_[static_cast<size_t>(s)], &flag, MPI_STATUS_IGNORE));
      if (!flag) return false;
    }
    return true;
  }
  void wait_sends_of(int seg) {
    for (int s = 0; s < step_; ++s)
      if (send_seg(s) == seg) wait_request(&sends_[static_cast<size_t>(s)]);
  }

  // False when the step receives in place and a send from there is still out.
  bool post_recv(int t) {
    const int seg = recv_seg(t);
    const bool reduce = t < size_ - 1;
    if (!reduce && !sends_of_done(seg)) return false;
    PYCOMM_MPI_CHECK(MPI_Irecv(reduce ? tmp_.data() : seg_ptr(seg), checked_count(seg_len(seg) * 2), MPI_BYTE, left_,
                               tag_, comm_, &recv_));
    recv_posted_ = true;
    return true;
  }

  // The receive of step_ is complete: add it (reduce-scatter steps), pass it on.
  void advance() {
    const int seg = recv_seg(step_);
    if (step_ < size_ - 1) kernels::reduce_cpu(seg_ptr(seg), tmp_.data(), seg_len(seg), half_, ReduceOp::SUM);
    recv_posted_ = false;
    ++step_;
    if (step_ < steps_) post_send(step_);  // send_seg(t+1) == recv_seg(t)
  }

  char* data_;
  size_t count_;
  DType half_;
  MPI_Comm comm_;
  int tag_, rank_ = 0, size_ = 1, left_ = 0, right_ = 0, steps_ = 0, step_ = 0;
  bool recv_posted_ = false;
  MPI_Request recv_ = MPI_REQUEST_NULL;
  std::vector<MPI_Request> sends_;
  std::vector<char> tmp_;
};

size_t round64(size_t bytes) { return (bytes + 63) & ~size_t(63); }

// The node stage of the schedule above, chunk by chunk; see the file comment.
class NodeChunks {
 public:
  NodeChunks(const CompressedArgs& a, ShmWindow& shm, size_t shm_chunk_bytes, size_t result_bytes)
      : x_(static_cast<const float*>(a.input.data)), mask_(static_cast<const uint8_t*>(a.mask.data)), shm_(shm) {
    n_ = a.input.count;
    L_ = shm.size();
    me_ = shm.rank();
    const size_t len0 = part_size(n_, L_, 0);  // the longest slice
    k_ = len0;
    if (shm_chunk_bytes > 0 && n_ * sizeof(float) > shm_chunk_bytes)
      k_ = std::min(len0, std::max<size_t>(16, shm_chunk_bytes / (sizeof(float) * L_) / 16 * 16));
    k_ = std::max<size_t>(k_, 1);
    chunks_ = (len0 + k_ - 1) / k_;
    slot_bytes_ = round64(static_cast<size_t>(L_) * k_ * sizeof(float));
    slots_ = chunks_ > 1 ? 2 : 1;
    shm.reserve(slots_ * slot_bytes_ + round64(result_bytes));  // settles first
  }

  size_t chunks() const { return chunks_; }
  size_t piece_elems() const { return k_; }
  // Elements [piece_begin(l, t), + piece_len(l, t)) of slice l, offsets within the slice.
  size_t piece_begin(size_t t) const { return t * k_; }
  size_t piece_len(int l, size_t t) const {
    const size_t len = part_size(n_, L_, l);
    return t * k_ < len ? std::min(k_, len - t * k_) : 0;
  }
  char* result(int l) const { return shm_.segment(l) + slots_ * slot_bytes_; }  // the per-rank result region
  int bad_input() const { return bad_input_; }

  // Copy-in and fence of chunk t; between pieces, `progress` (the rings on the wire).
  template <class Progress>
  void copy_in(size_t t, Progress&& progress) {
    char* slot = shm_.mine() + (t % slots_) * slot_bytes_;
    for (int j = 1; j < L_; ++j) {
      const int l = (me_ + j) % L_;
      const size_t len = piece_len(l, t), g = part_begin(n_, L_, l) + piece_begin(t);
      float* dst = reinterpret_cast<float*>(slot) + static_cast<size_t>(l) * k_;
      if (len) {
        std::memcpy(dst, x_ + g, len * sizeof(float));
        bad_input_ |= compressed_detail::has_nonfinite(dst, mask_ ? mask_ + g : nullptr, len);
      }
      progress();
    }
    shm_.fence();
  }

  // This rank's piece t of the node sum into dst (len = piece_len(me, t)):
  // x + seg(me+1) + ... + seg(me-1), local ranks mod L.
  template <class Progress>
  void sum(size_t t, float* dst, Progress&& progress) {
    const size_t len = piece_len(me_, t), g = part_begin(n_, L_, me_) + piece_begin(t);
    if (!len) return;
    std::memcpy(dst, x_ + g, len * sizeof(float));
    bad_input_ |= compressed_detail::has_nonfinite(dst, mask_ ? mask_ + g : nullptr, len);
    const size_t off = (t % slots_) * slot_bytes_ + static_cast<size_t>(me_) * k_ * sizeof(float);
    for (int j = 1; j < L_; ++j) {
      kernels::reduce_cpu(dst, shm_.segment((me_ + j) % L_) + off, len, DType::F32, ReduceOp::SUM);
      progress();
    }
  }

 private:
  const float* x_;
  const uint8_t* mask_;
  ShmWindow& shm_;
  size_t n_ = 0, k_ = 1, chunks_ = 1, slot_bytes_ = 0, slots_ = 1;
  int L_ = 1, me_ = 0;
  int bad_input_ = 0;
};

void half_hierarchical(const CompressedArgs& a, const Topology& topo, ShmWindow& shm, size_t shm_chunk_bytes,
                       const compressed_detail::NodeSlice& s, MemoryMover& memory, CompressedStats* stats) {
  const DType half = a.compression == Compression::BF16 ? DType::BF16 : DType::F16;
  const float weight = a.average ? 1.0f / static_cast<float>(topo.size) : 1.0f;
  const size_t n = a.input.count;
  NodeChunks node(a, shm, shm_chunk_bytes, part_size(n, s.L, 0) * 2);
  MemoryMover::Lease lease = memory.compressed_memory(node.piece_elems() * sizeof(float));
  float* node_piece = static_cast<float*>(lease.get());  // one chunk's node sum
  uint16_t* mine = reinterpret_cast<uint16_t*>(node.result(s.me));  // this slice's halves

  std::deque<HalfRing> rings;  // on the wire, oldest first
  auto progress = [&rings] {
    while (!rings.empty() && rings.front().progress()) rings.pop_front();
    for (auto& r : rings) r.progress();
  };
  int overflow = 0;
  uint64_t wire = 0;
  timeline::Phase phase("PIPELINE");
  for (size_t t = 0; t < node.chunks(); ++t) {
    node.copy_in(t, progress);
    node.sum(t, node_piece, progress);
    const size_t len = node.piece_len(s.me, t);
    uint16_t* h = mine + node.piece_begin(t);
    if (len) {
      int bad = 0;  // the cast sets its flag
      kernels::cast_to_half_cpu(node_piece, h, len, half, weight, &bad);
      overflow |= bad;
    }
    if (s.M > 1 && len) {
      if (rings.size() >= static_cast<size_t>(kInFlight)) {
        rings.front().finish();
        rings.pop_front();
      }
      rings.emplace_back(h, len, half, topo.cross, kCrossTag + static_cast<int>(t % kTags));
      wire += ring_wire_bytes(len, 2, s.M, s.cross_rank);
    }
    progress();
  }
  phase.next("CROSS_NODE_WAIT");
  for (auto& r : rings) r.finish();
  rings.clear();
  stats->wire_bytes = wire;
  overflow |= compressed_detail::half_has_nonfinite(mine, s.len, half);
  compressed_detail::agree_finite(node.bad_input(), topo.world, topo.size, a, "inf or NaN");
  if (compressed_detail::any_rank(overflow, topo.world)) compressed_detail::throw_half_overflow(a, half);
  phase.next("LOCAL_ALLGATHER");
  shm.fence();  // every slice's halves are final
  float* out = static_cast<float*>(a.output.data);
  for (int j = 0; j < s.L; ++j) {
    const int l = (s.me + j) % s.L;
    const size_t len = part_size(n, s.L, l);
    if (len) kernels::cast_to_float_cpu(node.result(l), out + part_begin(n, s.L, l), len, half, 1.0f);
  }
  shm.fence();  // nobody reads the window any more
}

void onebit_hierarchical(const CompressedArgs& a, const Topology& topo, ShmWindow& shm, size_t shm_chunk_bytes,
                         const compressed_detail::NodeSlice& s, MemoryMover& memory) {
  const size_t n = a.input.count;
  const OneBitLayout widest = onebit_layout(part_size(n, s.L, 0), s.M);
  NodeChunks node(a, shm, shm_chunk_bytes, widest.block_bytes() * static_cast<size_t>(s.M));
  // Working memory: the slice's node sum (len floats), then the cross-node scheme's buffers.
  const size_t sum_bytes = compressed_detail::ws_aligned(s.len * sizeof(float));
  MemoryMover::Lease lease =
      memory.compressed_memory(sum_bytes + compressed_detail::onebit_workspace_bytes(s.len, s.M));
  float* sum = static_cast<float*>(lease.get());
  const uint8_t* mask = static_cast<const uint8_t*>(a.mask.data);
  const uint8_t* slice_mask = mask ? mask + s.begin : nullptr;
  int overflow = 0;
  auto none = [] {};
  timeline::Phase phase("LOCAL_REDUCE_SCATTER");
  for (size_t t = 0; t < node.chunks(); ++t) {
    node.copy_in(t, none);
    float* piece = sum + node.piece_begin(t);
    node.sum(t, piece, none);
    const size_t len = node.piece_len(s.me, t);
    if (len) overflow |= compressed_detail::has_nonfinite(piece, slice_mask ? slice_mask + node.piece_begin(t) : nullptr,
                                                          len);
  }
  compressed_detail::agree_finite(node.bad_input(), topo.world, topo.size, a, "inf or NaN");
  if (compressed_detail::any_rank(overflow, topo.world)) compressed_detail::throw_node_sum_overflow(a);

  phase.next("CROSS_NODE");
  CompressedArgs c = a;
  c.input.data = sum;
  c.output.data = nullptr;  // not written: the allgather goes to the window
  c.input.count = c.output.count = s.len;
  c.worker_residual.data = static_cast<float*>(a.worker_residual.data) + s.begin;
  c.worker_residual.count = s.len;
  c.server_residual.count = onebit_layout(s.len, s.M).chunk;  // a prefix of the flat layout's chunk (see header)
  c.mask.data = const_cast<uint8_t*>(slice_mask);
  const float weight = a.average ? 1.0f / static_cast<float>(topo.size) : 1.0f;
  if (s.len) {
    compressed_detail::onebit_two_phase(c, topo.cross, weight, cpu_device_ops(), nullptr,
                                        static_cast<uint8_t*>(lease.get()) + sum_bytes,
                                        reinterpret_cast<uint8_t*>(node.result(s.me)));
  }

  phase.next("LOCAL_ALLGATHER");
  shm.fence();  // every slice's blocks are in the window
  float* out = static_cast<float*>(a.output.data);
  for (int j = 0; j < s.L; ++j) {
    const int l = (s.me + j) % s.L;
    const size_t b = part_begin(n, s.L, l);
    const OneBitLayout lay = onebit_layout(part_size(n, s.L, l), s.M);
    const uint8_t* blocks = reinterpret_cast<const uint8_t*>(node.result(l));
    for (int i = 0; i < s.M; ++i) {
      const size_t cb = lay.begin(i), len = lay.length(i);
      if (!len) continue;
      const uint8_t* block = blocks + static_cast<size_t>(i) * lay.block_bytes();
      float scale;
      std::memcpy(&scale, block + lay.bit_bytes(), sizeof scale);
      kernels::onebit_decompress_cpu(block, &scale, len, lay.chunk, out + b + cb, mask ? mask + b + cb : nullptr);
    }
  }
  shm.fence();  // nobody reads the window any more
}

}  // namespace

void hierarchical_compressed_allreduce(const CompressedArgs& a, const Topology& topo, ShmWindow& shm,
                                       size_t shm_chunk_bytes, MemoryMover& memory, CompressedStats* stats) {
  const compressed_detail::NodeSlice s = compressed_detail::node_slice(a, topo, stats);
  if (a.input.count == 0) return;
  if (a.compression == Compression::ONEBIT) onebit_hierarchical(a, topo, shm, shm_chunk_bytes, s, memory);
  else half_hierarchical(a, topo, shm, shm_chunk_bytes, s, memory, stats);
}

}  // namespace comm
}  // namespace pycomm
