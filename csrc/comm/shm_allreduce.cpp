#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include <algorithm>

#include "../kernels/fusion.h"
#include "../kernels/reduce.h"
#include "algorithms.h"
#include "shm_window.h"
#include "stage_clock.h"
#include "timeline.h"
#include "window_copy.h"

namespace pycomm {
namespace comm {
namespace shm_detail {

using stage_clock::StageClock;

// Reduce this rank's slice of `count` elements over every segment into its own segment;
// returns the bytes read and written.
uint64_t reduce_own_slice(size_t count, DType dtype, ReduceOp op, ShmWindow& shm);

// Copy this rank's data into its segment, then reduce this rank's slice
// [part_begin(count, L, local_rank), ...) over every segment into its own
// segment. On return (after a fence) segment r's slice r holds the node's
// reduction of slice r. Returns the reduction's memory traffic (stage_clock.h).
uint64_t reduce_own_slice(size_t count, DType dtype, ReduceOp op, ShmWindow& shm) {
  const size_t esize = kernels::dtype_size(dtype);
  const int L = shm.size(), me = shm.rank();
  const size_t begin = part_begin(count, L, me), len = part_size(count, L, me);
  char* dst = shm.mine() + begin * esize;
  for (int k = 1; k < L; ++k) {
    int peer = (me + k) % L;  // start at a different peer on every rank to spread the load
    kernels::reduce_cpu(dst, shm.segment(peer) + begin * esize, len, dtype, op);
  }
  return stage_clock::reduction_bytes(len * esize, L - 1);
}

void reduce_scatter_into_segments(const Buffer& buf, ReduceOp op, ShmWindow& shm) {
  shm.reserve(buf.bytes());
  StageClock clock;
  std::memcpy(shm.mine(), buf.data, buf.bytes());
  clock.mark(stage_clock::kCopyIn, stage_clock::copy_bytes(buf.bytes()));
  shm.fence();
  clock.mark(stage_clock::kBarrier);
  clock.mark(stage_clock::kReduce, reduce_own_slice(buf.count, buf.dtype, op, shm));
  shm.fence();
  clock.mark(stage_clock::kBarrier);
}

// Copy each rank's reduced slice out of its segment into `buf`, then fence so
// nobody overwrites a segment that a peer is still reading.
void allgather_from_segments(const Buffer& buf, ShmWindow& shm) {
  const size_t esize = kernels::dtype_size(buf.dtype);
  const int L = shm.size();
  StageClock clock;
  for (int k = 0; k < L; ++k) {
    int owner = (shm.rank() + k) % L;
    size_t begin = part_begin(buf.count, L, owner), len = part_size(buf.count, L, owner);
    std::memcpy(buf.bytes_at(begin), shm.segment(owner) + begin * esize, len * esize);
  }
  clock.mark(stage_clock::kCopyOut, stage_clock::copy_bytes(buf.bytes()));
  shm.fence();
  clock.mark(stage_clock::kBarrier);
}

}  // namespace shm_detail

namespace {

using stage_clock::StageClock;

// Latency-bound sizes: one fence instead of three. Every rank copies its data
// into its segment (half of it, alternating, see ShmWindow::take_half),
// fences, and reduces the whole message from the L segments in rank order
// (so every rank computes bitwise the same values). Per rank: write S, read
// L S, reduce (L-1) S; one node barrier. The three-fence form moves less
// (each rank reduces 1/L) but pays two more barriers, which dominate below
// kShmOneFenceBytes (bench/latency.py --sizes).
void one_fence_allreduce(const Buffer& buf, ReduceOp op, ShmWindow& shm, const window_copy::WindowCall& call) {
  const size_t bytes = buf.bytes();
  const size_t offset = shm.take_half(bytes);
  StageClock clock;
  call.copy(shm.mine() + offset, buf.data, bytes);
  clock.mark(stage_clock::kCopyIn, stage_clock::copy_bytes(bytes));
  shm.fence();
  clock.mark(stage_clock::kBarrier);
  std::memcpy(buf.data, shm.segment(0) + offset, bytes);
  clock.mark(stage_clock::kCopyOut, stage_clock::copy_bytes(bytes));
  for (int r = 1; r < shm.size(); ++r) kernels::reduce_cpu(buf.data, shm.segment(r) + offset, buf.count, buf.dtype, op);
  clock.mark(stage_clock::kReduce, stage_clock::reduction_bytes(bytes, shm.size() - 1));
}

// Large messages: the three steps chunk by chunk through two window halves (see algorithms.h), over
// `count` flat elements. copy_in(begin, n, dst) writes flat elements [begin, begin + n) of this rank's
// input to window memory `dst`; copy_out(begin, n, src) writes the node's reduction of those elements,
// read from window memory `src`, to this rank's output. The plain allreduce copies one buffer; the
// fused one gathers from and scatters to its tensors (packing and unpacking are the copies).
//
// `in_place`: this rank's flat data, read and written in place (the plain allreduce). Its own slice
// of each chunk then never goes through the window: it is reduced where it lies, from the L-1 peers'
// segments, and only the result is copied into the window for the peers. That saves a copy of S/L
// per rank: copy-in and copy-out move (L-1)/L S each instead of S, and the publish moves S/L.
// Alternating before and after, 2 ranks, bench/allreduce.py --algorithms shm (docs/benchmarks.md):
// 1 MiB in one pass 72-75 -> 58-59 us, 16 MiB chunk by chunk 1.71-1.81 -> 1.47-1.71 ms.
//
// One chunk (chunk_bytes >= the message) is the one-pass form: its window is one half, not two, and
// `one_pass`, its timeline phase, moves on to LOCAL_ALLGATHER at the copy-out.
template <class CopyIn, class CopyOut>
void chunked_allreduce(size_t count, DType dtype, ReduceOp op, ShmWindow& shm, size_t chunk_bytes,
                       const window_copy::WindowCall& call, CopyIn copy_in, CopyOut copy_out, char* in_place = nullptr,
                       timeline::Phase* one_pass = nullptr) {
  const size_t esize = kernels::dtype_size(dtype);
  const int L = shm.size(), me = shm.rank();
  // Whole elements, whole cache lines: each half starts on a 64-byte boundary.
  const size_t chunk_elems = std::max<size_t>(((chunk_bytes + 63) & ~size_t(63)) / esize, 1);
  const size_t half_bytes = (chunk_elems * esize + 63) & ~size_t(63);
  const size_t chunks = (count + chunk_elems - 1) / chunk_elems;
  shm.reserve(chunks > 1 ? 2 * half_bytes : half_bytes);  // settles first
  auto chunk_len = [&](size_t c) { return std::min(chunk_elems, count - c * chunk_elems); };
  StageClock clock;
  // Chunk c into window half `dst`: all of it, or in place all but this rank's own slice.
  auto copy_chunk_in = [&](size_t c, char* dst) {
    const size_t begin = c * chunk_elems, len = chunk_len(c);
    if (!in_place) {
      copy_in(begin, len, dst);
      return clock.mark(stage_clock::kCopyIn, stage_clock::copy_bytes(len * esize));
    }
    const size_t s_begin = part_begin(len, L, me), s_end = s_begin + part_size(len, L, me);
    if (s_begin) copy_in(begin, s_begin, dst);
    if (s_end < len) copy_in(begin + s_end, len - s_end, dst + s_end * esize);
    clock.mark(stage_clock::kCopyIn, stage_clock::copy_bytes((len - (s_end - s_begin)) * esize));
  };
  copy_chunk_in(0, shm.mine());
  for (size_t c = 0; c < chunks; ++c) {
    const size_t offset = (c & 1) * half_bytes, begin = c * chunk_elems, len = chunk_len(c);
    shm.fence();  // chunk c is in every segment's half
    clock.mark(stage_clock::kBarrier);
    const size_t s_begin = part_begin(len, L, me), s_len = part_size(len, L, me);
    char* dst = in_place ? in_place + (begin + s_begin) * esize : shm.mine() + offset + s_begin * esize;
    for (int k = 1; k < L; ++k) {
      const int peer = (me + k) % L;  // a different first peer on every rank spreads the load
      kernels::reduce_cpu(dst, shm.segment(peer) + offset + s_begin * esize, s_len, dtype, op);
    }
    clock.mark(stage_clock::kReduce, stage_clock::reduction_bytes(s_len * esize, L - 1));
    if (in_place) {  // the peers copy this rank's slice out of its window
      call.copy(shm.mine() + offset + s_begin * esize, dst, s_len * esize);
      clock.mark(stage_clock::kCopyIn, stage_clock::copy_bytes(s_len * esize));
    }
    shm.fence();  // every slice of chunk c is reduced
    clock.mark(stage_clock::kBarrier);
    if (one_pass) one_pass->next("LOCAL_ALLGATHER");
    for (int k = in_place ? 1 : 0; k < L; ++k) {
      const int owner = (me + k) % L;
      const size_t o_begin = part_begin(len, L, owner), o_len = part_size(len, L, owner);
      if (o_len) copy_out(begin + o_begin, o_len, shm.segment(owner) + offset + o_begin * esize);
    }
    clock.mark(stage_clock::kCopyOut, stage_clock::copy_bytes((in_place ? len - s_len : len) * esize));
    // Chunk c+1 goes to the other half, which chunk c-1 used: every rank copied chunk c-1 out
    // before the first fence of chunk c.
    if (c + 1 < chunks) copy_chunk_in(c + 1, shm.mine() + ((c + 1) & 1) * half_bytes);
  }
  shm.fence();  // nobody reads the window any more: it is free for any other use
  clock.mark(stage_clock::kBarrier);
}

void pipelined_allreduce(const Buffer& buf, ReduceOp op, ShmWindow& shm, size_t chunk_bytes,
                         const window_copy::WindowCall& call, timeline::Phase* one_pass) {
  const size_t esize = kernels::dtype_size(buf.dtype);
  chunked_allreduce(
      buf.count, buf.dtype, op, shm, chunk_bytes, call,
      [&](size_t begin, size_t n, char* dst) { call.copy(dst, buf.bytes_at(begin), n * esize); },
      [&](size_t begin, size_t n, const char* src) { std::memcpy(buf.bytes_at(begin), src, n * esize); },
      static_cast<char*>(buf.data), one_pass);
}

// The pieces of a fused batch's flat range: `starts` holds each tensor's flat offset (and the total
// last); calls fn(tensor, element offset in it, element offset in the range, length) for each piece
// of [begin, begin + n).
template <class Fn>
void for_each_piece(const FusedTensors& t, const std::vector<size_t>& starts, size_t begin, size_t n, Fn fn) {
  size_t k = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
  for (size_t done = 0; done < n; ++k) {
    const size_t at = begin + done - starts[k], len = std::min(t.counts[k] - at, n - done);
    if (len) fn(k, at, done, len);
    done += len;
  }
}

std::vector<size_t> fused_starts(const FusedTensors& t) {
  std::vector<size_t> starts(t.counts.size() + 1, 0);
  for (size_t k = 0; k < t.counts.size(); ++k) starts[k + 1] = starts[k] + t.counts[k];
  return starts;
}

// Packing: flat elements [begin, begin + n) of the batch gathered from its tensors into window
// memory `dst`, pre-divided there by N for fp16/bf16 averages.
void pack_flat_range(const FusedTensors& t, const std::vector<size_t>& starts, size_t begin, size_t n, char* dst,
                     const window_copy::WindowCall& call, bool pre_divide) {
  const size_t esize = kernels::dtype_size(t.dtype);
  for_each_piece(t, starts, begin, n, [&](size_t k, size_t at, size_t off, size_t len) {
    call.copy(dst + off * esize, static_cast<const char*>(t.srcs[k]) + at * esize, len * esize);
  });
  if (pre_divide && n) kernels::scale_cpu(dst, n, t.dtype, 1.0 / static_cast<double>(t.world_size));
}

// Unpacking: the node's reduction of flat elements [begin, begin + n), read from window memory
// `src`, scattered to the batch's result tensors with the unpack scale.
void unpack_flat_range(const FusedTensors& t, const std::vector<size_t>& starts, size_t begin, size_t n,
                       const char* src, double unpack_scale) {
  const size_t esize = kernels::dtype_size(t.dtype);
  for_each_piece(t, starts, begin, n, [&](size_t k, size_t at, size_t off, size_t len) {
    void* dst = static_cast<char*>(t.dsts[k]) + at * esize;
    kernels::fusion_unpack_cpu(src + off * esize, &dst, &len, 1, t.dtype, unpack_scale);
  });
}

// The fused batch chunk by chunk: a chunk's flat range gathered from the tensors that overlap it,
// pre-divided in the window (fp16/bf16 averages), scattered back with the unpack scale.
void pipelined_fused_allreduce(const FusedTensors& t, size_t total, ReduceOp op, bool pre_divide, double unpack_scale,
                               ShmWindow& shm, size_t chunk_bytes) {
  const size_t esize = kernels::dtype_size(t.dtype);
  const std::vector<size_t> starts = fused_starts(t);
  window_copy::WindowCall call(total * esize);
  chunked_allreduce(
      total, t.dtype, op, shm, chunk_bytes, call,
      [&](size_t begin, size_t n, char* dst) { pack_flat_range(t, starts, begin, n, dst, call, pre_divide); },
      [&](size_t begin, size_t n, const char* src) { unpack_flat_range(t, starts, begin, n, src, unpack_scale); });
  call.finish();
}

// The last-level cache that CPU 0 sees (every rank of a node reads the same value): the kernel's
// cache topology first, since in virtual machines sysconf reports the host's whole socket (384 MiB
// where sysfs and lscpu say 32 MiB); then sysconf; else 32 MiB.
size_t last_level_cache_bytes() {
  static const size_t bytes = [] {
    size_t best = 0;
    int best_level = 0;
    for (int index = 0; index < 8; ++index) {
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
      std::ifstream level_file(dir + "level"), type_file(dir + "type"), size_file(dir + "size");
      int level = 0;
      std::string type, size;
      if (!(level_file >> level) || !(type_file >> type) || !(size_file >> size)) break;
      if (type == "Instruction" || level < best_level || size.empty()) continue;
      char* end = nullptr;
      size_t v = std::strtoull(size.c_str(), &end, 10);
      if (*end == 'K') v <<= 10;
      else if (*end == 'M') v <<= 20;
      if (v) best = v, best_level = level;
    }
    if (best) return best;
    for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
      const long v = sysconf(name);
      if (v > 0) return static_cast<size_t>(v);
    }
    return size_t(32) << 20;
  }();
  return bytes;
}

}  // namespace

// The cache the pipeline threshold counts on: the last level, at most 32 MiB. A virtual machine may
// be shown its host's whole L3 (480 MiB on a 2-core one, in sysfs and lscpu alike), shared with every
// other guest; there, the one pass ran to 120 MiB on 2 ranks and took 24.5-25.4 ms at 64 MiB against
// 13.0-13.6 ms chunk by chunk, and 3.3 against 2.5-2.7 ms at 16 MiB (bench/allreduce.py, 2 ranks,
// --algorithms ring,shm, alternating the two thresholds twice). 32 MiB is the L3 of the machine the
// threshold was first measured on.
constexpr size_t kPipelineCacheBytes = size_t(32) << 20;

size_t shm_pipeline_min_bytes(int local_size, size_t chunk_bytes) {
  const size_t cache = std::min(last_level_cache_bytes(), kPipelineCacheBytes);
  return std::max(chunk_bytes, cache / (2 * static_cast<size_t>(std::max(local_size, 1))));
}

// One node, one pass: as the plain one pass, this rank's own slice of the flat batch is reduced
// where it lies (in its result tensors) and only the result goes into the window; the other
// (L-1)/L is packed into the window and, after the second fence, unpacked from the peers' segments.
// The own slice is pre-divided (fp16/bf16 averages) before its reduction and takes the unpack scale
// after its result is published, by the same kernels as the window's copies, so every rank holds
// the same bits.
void one_node_fused_allreduce(const FusedTensors& t, size_t total, ReduceOp op, bool pre_divide, double unpack_scale,
                              ShmWindow& shm) {
  const size_t esize = kernels::dtype_size(t.dtype);
  const int L = shm.size(), me = shm.rank();
  const size_t own_begin = part_begin(total, L, me), own_len = part_size(total, L, me);
  const std::vector<size_t> starts = fused_starts(t);
  const double inv_n = 1.0 / static_cast<double>(t.world_size);
  shm.reserve(total * esize);
  window_copy::WindowCall call(total * esize);
  StageClock clock;
  // Packing is the copy-in: the peers' slices of the batch go to this rank's window segment.
  const size_t own_end = own_begin + own_len;
  pack_flat_range(t, starts, 0, own_begin, shm.mine(), call, pre_divide);
  pack_flat_range(t, starts, own_end, total - own_end, shm.mine() + own_end * esize, call, pre_divide);
  clock.mark(stage_clock::kCopyIn, stage_clock::copy_bytes((total - own_len) * esize));
  shm.fence();
  clock.mark(stage_clock::kBarrier);
  for_each_piece(t, starts, own_begin, own_len, [&](size_t k, size_t at, size_t off, size_t len) {
    char* dst = static_cast<char*>(t.dsts[k]) + at * esize;
    const char* src = static_cast<const char*>(t.srcs[k]) + at * esize;
    if (dst != src) std::memcpy(dst, src, len * esize);
    if (pre_divide) kernels::scale_cpu(dst, len, t.dtype, inv_n);
    for (int j = 1; j < L; ++j) {
      const int peer = (me + j) % L;  // the order of reduce_own_slice: the same bits as the window's form
      kernels::reduce_cpu(dst, shm.segment(peer) + (own_begin + off) * esize, len, t.dtype, op);
    }
  });
  clock.mark(stage_clock::kReduce, stage_clock::reduction_bytes(own_len * esize, L - 1));
  // The peers unpack this rank's slice as it is in the window, unscaled.
  for_each_piece(t, starts, own_begin, own_len, [&](size_t k, size_t at, size_t off, size_t len) {
    char* dst = static_cast<char*>(t.dsts[k]) + at * esize;
    call.copy(shm.mine() + (own_begin + off) * esize, dst, len * esize);
    if (unpack_scale != 1.0) kernels::scale_cpu(dst, len, t.dtype, unpack_scale);
  });
  clock.mark(stage_clock::kCopyIn, stage_clock::copy_bytes(own_len * esize));
  shm.fence();
  clock.mark(stage_clock::kBarrier);
  // Unpacking is the copy-out: the peers' slices, with the average's 1/N applied on the way.
  for (int j = 1; j < L; ++j) {
    const int owner = (me + j) % L;
    const size_t o_begin = part_begin(total, L, owner);
    unpack_flat_range(t, starts, o_begin, part_size(total, L, owner), shm.segment(owner) + o_begin * esize,
                      unpack_scale);
  }
  clock.mark(stage_clock::kCopyOut, stage_clock::copy_bytes((total - own_len) * esize));
  shm.fence();
  clock.mark(stage_clock::kBarrier);
  call.finish();
}

void windowed_fused_allreduce(const FusedTensors& t, ReduceOp op, bool pre_divide, double unpack_scale,
                              ShmWindow& shm, MPI_Comm cross, size_t chunk_bytes, size_t shm_chunk_bytes) {
  const size_t esize = kernels::dtype_size(t.dtype);
  size_t total = 0;
  for (size_t c : t.counts) total += c;
  if (total == 0) return;
  if (cross == MPI_COMM_NULL && shm_chunk_bytes > 0 &&
      total * esize > shm_pipeline_min_bytes(shm.size(), shm_chunk_bytes))
    return pipelined_fused_allreduce(t, total, op, pre_divide, unpack_scale, shm, shm_chunk_bytes);
  if (cross == MPI_COMM_NULL) return one_node_fused_allreduce(t, total, op, pre_divide, unpack_scale, shm);
  const int L = shm.size(), me = shm.rank();
  shm.reserve(total * esize);
  // Across nodes the ring's time would drown the copy's: ordinary stores, unless a process fixed them.
  window_copy::WindowCall call(0);
  StageClock clock;
  // Packing is the copy-in: the fused buffer is this rank's window segment.
  call.pack(t.srcs.data(), t.counts.data(), t.counts.size(), shm.mine(), t.dtype);
  if (pre_divide) kernels::scale_cpu(shm.mine(), total, t.dtype, 1.0 / static_cast<double>(t.world_size));
  clock.mark(stage_clock::kCopyIn, stage_clock::copy_bytes(total * esize));
  shm.fence();
  clock.mark(stage_clock::kBarrier);
  clock.mark(stage_clock::kReduce, shm_detail::reduce_own_slice(total, t.dtype, op, shm));
  // Across nodes: this rank's reduced shard, in its segment, around the ring of its local rank.
  int cross_size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_size(cross, &cross_size));
  Buffer shard;
  shard.dtype = t.dtype;
  shard.data = shm.mine() + part_begin(total, L, me) * esize;
  shard.count = part_size(total, L, me);
  if (cross_size > 1 && shard.count) ring_allreduce(shard, op, cross, chunk_bytes);
  clock.skip();  // the ring keeps its own stages
  shm.fence();
  clock.mark(stage_clock::kBarrier);
  // Unpacking is the copy-out: each tensor is read straight from the
  // segments that own its pieces, with the average's 1/N applied on the way.
  size_t offset = 0;
  for (size_t k = 0; k < t.counts.size(); ++k) {
    size_t done = 0;
    while (done < t.counts[k]) {
      size_t flat = offset + done;
      int owner = 0;
      while (part_begin(total, L, owner + 1) <= flat) ++owner;
      size_t piece = std::min(t.counts[k] - done, part_begin(total, L, owner + 1) - flat);
      void* dst = static_cast<char*>(t.dsts[k]) + done * esize;
      kernels::fusion_unpack_cpu(shm.segment(owner) + flat * esize, &dst, &piece, 1, t.dtype, unpack_scale);
      done += piece;
    }
    offset += t.counts[k];
  }
  clock.mark(stage_clock::kCopyOut, stage_clock::copy_bytes(total * esize));
  shm.fence();
  clock.mark(stage_clock::kBarrier);
  call.finish();
}

void shm_allreduce(const Buffer& buf, ReduceOp op, ShmWindow& shm, size_t chunk_bytes) {
  if (buf.count == 0 || shm.size() == 1) return;
  window_copy::WindowCall call(buf.bytes());
  if (buf.bytes() <= kShmOneFenceBytes) {
    timeline::Phase phase("LOCAL_ALLREDUCE");
    one_fence_allreduce(buf, op, shm, call);
  } else if (chunk_bytes > 0 && buf.bytes() > shm_pipeline_min_bytes(shm.size(), chunk_bytes)) {
    timeline::Phase phase("LOCAL_PIPELINED_ALLREDUCE");
    pipelined_allreduce(buf, op, shm, chunk_bytes, call, nullptr);
  } else {
    // One pass: the chunked schedule with one chunk, the whole message.
    timeline::Phase phase("LOCAL_REDUCE_SCATTER");
    pipelined_allreduce(buf, op, shm, buf.bytes(), call, &phase);
  }
  call.finish();
}

}  // namespace comm
}  // namespace pycomm
