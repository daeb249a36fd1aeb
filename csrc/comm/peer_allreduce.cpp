// Peer allreduce (peer_allreduce.h): the node's L ranks reduce device memory
// by reading each other's blocks, the way NCCL's P2P/IPC transport does, with
// no CUDA-aware MPI. Rank me owns slice me = part(count, L, me); every block
// has two halves, and consecutive passes alternate them.
//
// One pass over S bytes, rank me, half h:
//   0. once a call  the ranks agree over the world that each is on the device it was probed on
//                   (one MPI_Allreduce of an int), and regrow their blocks together if the call needs it
//   1. copy in      B_me[h] = x (times the average's pre-division for fp16/bf16)
//                   signal 0; node barrier
//   2. reduce       wait for every peer's signal 0;
//                   B_me[h][slice me] = reduce over r of B_r[h][slice me], peers in rank order from me + 1
//                   across nodes: slice me is allreduced over `cross` by the ring, staged through host memory
//                   (times 1/N for an average); signal 1; node barrier
//   3. gather       wait for every peer's signal 1; out[slice r] = B_r[h][slice r] for every r
// Bytes per rank: S copied in, (L-1) S/L read from peers in step 2 and again
// in step 3, S/L written; 2 (M-1)/M S/L per rank on the wire across M nodes.
// Two host barriers a pass and one small allreduce a call; the host never waits for the device except before
// MPI reads a shard (across nodes) and when a block is reallocated.
//
// Why the halves: a peer may still be reading B_me[h] in step 3 of pass k
// while this rank starts pass k+1. Pass k+1 writes the other half; pass k+2
// writes h again only after its step 2 of pass k+1 waited for every peer's
// signal 0 of pass k+1, which each peer recorded after its step 3 of pass k.
// Each slice is reduced by one rank only, so every rank ends with the same bits.
#include "peer_allreduce.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "algorithms.h"
#include "fault.h"
#include "memory_mover.h"
#include "staging.h"
#include "timeline.h"

namespace pycomm {
namespace comm {
namespace {

constexpr size_t kReasonBytes = 512;

// 64-byte alignment of every block half, so every slice starts where vector loads want it.
size_t aligned(size_t bytes) { return (bytes + 63) & ~size_t(63); }

// Collective over `world`: "" when no rank failed, else "rank R: <its failure>" for the lowest rank
// that failed, the same text on every rank.
std::string agree_on_failure(const std::string& failure, const Topology& topo) {
  int mine = failure.empty() ? topo.size : topo.rank, lowest = 0;
  PYCOMM_MPI_CHECK(MPI_Allreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, topo.world));
  if (lowest == topo.size) return std::string();
  char reason[kReasonBytes] = {};
  if (lowest == topo.rank) std::snprintf(reason, sizeof reason, "rank %d: %s", topo.rank, failure.c_str());
  PYCOMM_MPI_CHECK(MPI_Bcast(reason, static_cast<int>(sizeof reason), MPI_CHAR, lowest, topo.world));
  return reason;
}

}  // namespace

PeerAllreduce::PeerAllreduce(std::unique_ptr<PeerMemory> memory, int device, const Topology& topo)
    : memory_(std::move(memory)), device_(device), topo_(topo) {
  blocks_.assign(static_cast<size_t>(topo.local_size), nullptr);
  signals_.assign(static_cast<size_t>(topo.local_size) * PeerMemory::kSignals, nullptr);
}

std::unique_ptr<PeerAllreduce> PeerAllreduce::probe(std::unique_ptr<PeerMemory> memory, int device,
                                                    const Topology& topo, std::string* why) {
  std::unique_ptr<PeerAllreduce> peer(new PeerAllreduce(std::move(memory), device, topo));
  try {
    peer->exchange_blocks(64 << 10, true);  // agreed over the world: it throws on every rank or none
  } catch (const std::exception& e) {
    *why = e.what();
    return nullptr;  // the destructor closes the signals, on every rank alike
  }
  return peer;
}

PeerAllreduce::~PeerAllreduce() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // Like the shm window: after a rank failed the blocks stay mapped (closing them in order needs the node).
  if (finalized || fault::failed()) return;
  try {
    close_blocks();
    close_signals();
  } catch (...) {
  }
}

void PeerAllreduce::close_blocks() {
  const int L = topo_.local_size, me = topo_.local_rank;
  memory_->synchronize();  // this rank's reads of the peers' blocks have run
  PYCOMM_MPI_CHECK(MPI_Barrier(topo_.local));  // ... and every rank's reads of this rank's block
  for (int r = 0; r < L; ++r) {
    char*& b = blocks_[static_cast<size_t>(r)];
    if (r != me && b) memory_->close_block(b, 2 * half_);
    if (r != me) b = nullptr;
  }
  PYCOMM_MPI_CHECK(MPI_Barrier(topo_.local));  // every peer has closed this rank's block
  if (blocks_[static_cast<size_t>(me)]) memory_->release_block(blocks_[static_cast<size_t>(me)], 2 * half_);
  blocks_[static_cast<size_t>(me)] = nullptr;
  half_ = 0;
}

void PeerAllreduce::close_signals() {
  for (void*& s : signals_) {
    if (s) memory_->close_signal(s);
    s = nullptr;
  }
}

void PeerAllreduce::exchange_blocks(size_t half, bool with_signals) {
  const int L = topo_.local_size, me = topo_.local_rank;
  if (!with_signals) close_blocks();  // a regrowth: the same on every rank
  // What each rank exports: whether it could, its block's handle, then its signals' (once, with the first block).
  struct Exported {
    int ok = 0;
    PeerMemory::Handle block;
    PeerMemory::Handle signals[PeerMemory::kSignals];
  };
  Exported mine;
  std::string failure;
  half_ = half;
  try {
    blocks_[static_cast<size_t>(me)] = static_cast<char*>(memory_->export_block(2 * half, &mine.block));
    ++allocations_;
    if (with_signals) memory_->export_signals(mine.signals);
    mine.ok = 1;
  } catch (const std::exception& e) {
    failure = e.what();
  }
  std::vector<Exported> all(static_cast<size_t>(L));
  PYCOMM_MPI_CHECK(MPI_Allgather(&mine, static_cast<int>(sizeof(Exported)), MPI_BYTE, all.data(),
                                 static_cast<int>(sizeof(Exported)), MPI_BYTE, topo_.local));
  for (int r = 0; r < L && failure.empty(); ++r) {
    if (r == me) continue;
    const Exported& e = all[static_cast<size_t>(r)];
    try {
      if (!e.ok) throw CommError("local rank " + std::to_string(r) + " could not export its block");
      blocks_[static_cast<size_t>(r)] = static_cast<char*>(memory_->open_block(e.block, 2 * half));
      if (with_signals)
        for (int k = 0; k < PeerMemory::kSignals; ++k)
          signals_[static_cast<size_t>(r * PeerMemory::kSignals + k)] = memory_->open_signal(e.signals[k]);
    } catch (const std::exception& ex) {
      failure = ex.what();
    }
  }
  // Every peer has opened this rank's block (or given up): its name may go.
  PYCOMM_MPI_CHECK(MPI_Barrier(topo_.local));
  if (mine.ok) memory_->unpublish(mine.block);
  // Agreed over the world, as every rank regrows at the same call: no node runs on while another raises.
  const std::string reason = agree_on_failure(failure, topo_);
  if (!reason.empty()) {
    close_blocks();  // every rank: the next call starts from no blocks
    throw CommError(std::string(memory_->kind()) + ", " + reason);
  }
  next_half_ = 0;
}

void PeerAllreduce::run(const Buffer& in, const Buffer& out, ReduceOp op, const AverageRule& avg, int device,
                        size_t pass_bytes, MemoryMover& mover, StagingBuffers& staging, size_t staging_chunk_bytes,
                        size_t ring_chunk_bytes) {
  // Every rank must be on the memory it was probed on: agree before anything is written.
  int here = device == device_ ? 1 : 0, everywhere = 0;
  PYCOMM_MPI_CHECK(MPI_Allreduce(&here, &everywhere, 1, MPI_INT, MPI_MIN, topo_.world));
  if (!everywhere) {
    auto name = [](int d) { return d < 0 ? std::string("host memory") : "cuda:" + std::to_string(d); };
    throw CommError("peer allreduce: the peer path of this rank is bound to " + name(device_) +
                    (here ? "; another rank's tensor is on another device" : ", and this tensor is on " + name(device)) +
                    " (each rank uses one GPU for its CUDA allreduces; PYCOMM_PEER_PATH=0 stages them instead)");
  }
  if (out.count == 0) return;
  const size_t esize = kernels::dtype_size(out.dtype);
  // The block grows (collectively, the same on every rank) to the largest pass so far, geometrically
  // up to the pass size.
  const size_t pass_elems = std::max<size_t>(1, pass_bytes / esize);
  const size_t want = aligned(std::min(out.count, pass_elems) * esize);
  if (want > half_) exchange_blocks(std::max(want, std::min(2 * half_, aligned(pass_elems * esize))), false);
  timeline::Phase phase(timeline::on() ? "PEER_ALLREDUCE" : nullptr);
  for (size_t off = 0; off < out.count; off += pass_elems) {
    pass(in, out, off, std::min(pass_elems, out.count - off), next_half_, op, avg, mover, staging, staging_chunk_bytes,
         ring_chunk_bytes);
    next_half_ ^= 1;
  }
}

void PeerAllreduce::pass(const Buffer& in, const Buffer& out, size_t off, size_t n, int h, ReduceOp op,
                         const AverageRule& avg, MemoryMover& mover, StagingBuffers& staging,
                         size_t staging_chunk_bytes, size_t ring_chunk_bytes) {
  const int L = topo_.local_size, me = topo_.local_rank;
  const size_t esize = kernels::dtype_size(out.dtype);
  char* own = block(me, h);
  auto wait_all = [&](int k) {
    for (int r = 0; r < L; ++r)
      if (r != me) memory_->wait_signal(signals_[static_cast<size_t>(r * PeerMemory::kSignals + k)]);
  };

  // 1. copy in
  memory_->copy(own, in.bytes_at(off), n * esize);
  if (avg.before != 1.0) memory_->scale(own, n, out.dtype, avg.before);
  memory_->signal(0);
  PYCOMM_MPI_CHECK(MPI_Barrier(topo_.local));

  // 2. reduce this rank's slice from every block
  wait_all(0);
  const size_t begin = part_begin(n, L, me), len = part_size(n, L, me);
  for (int k = 1; k < L; ++k) {
    const int r = (me + k) % L;
    memory_->reduce(own + begin * esize, block(r, h) + begin * esize, len, out.dtype, op);
  }
  if (topo_.num_nodes > 1 && len) {
    Buffer shard = out;
    shard.data = own + begin * esize;
    shard.count = len;
    memory_->synchronize();  // MPI reads the node's shard next
    staged_allreduce(shard, shard, mover, staging, staging_chunk_bytes, [&](const Buffer& host) {
      ring_allreduce(host, op, topo_.cross, ring_chunk_bytes);
    });
  }
  if (avg.after != 1.0 && len) memory_->scale(own + begin * esize, len, out.dtype, avg.after);
  memory_->signal(1);
  PYCOMM_MPI_CHECK(MPI_Barrier(topo_.local));

  // 3. gather every slice, this rank's first
  wait_all(1);
  for (int k = 0; k < L; ++k) {
    const int r = (me + k) % L;
    const size_t b = part_begin(n, L, r), l = part_size(n, L, r);
    if (l) memory_->copy(out.bytes_at(off + b), block(r, h) + b * esize, l * esize);
  }
}

}  // namespace comm
}  // namespace pycomm
