// What callers hand the engine and what it reports: its options, each
// operation's arguments and its counters. Plain data, shared by the Engine
// (engine.h, which decides what runs) and its Executor (executor.h, which runs it).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "allreduce_catalogue.h"
#include "common.h"
#include "coordinator.h"

namespace pycomm {
namespace comm {

struct EngineOptions {
  size_t ring_chunk_bytes = size_t(1) << 19;     // 512 KiB pipeline chunks
  size_t shm_chunk_bytes = size_t(768) << 10;    // shm chunks (bench/shm_chunk.py); 0: in one pass
  size_t auto_ring_min_bytes = size_t(1) << 16;  // below this "auto" uses MPI_Allreduce (not on one node: shm)
  bool check_consistency = true;                 // coordinate (and compare) before each operation
  size_t fusion_threshold_bytes = size_t(64) << 20;  // 0 disables fusion
  double cycle_time_ms = 2.0;  // how long a fusable allreduce may wait for company
  StallOptions stall;
  size_t staging_chunk_bytes = size_t(4) << 20;  // device data travels through host chunks of this size
  bool force_staging = false;  // send host buffers through the staging pipeline too (tests its logic on CPU)
  bool force_device_direct = false;  // treat host buffers as device memory under a CUDA-aware MPI (same purpose)
  // CUDA tensors inside a node, under an MPI that cannot read device memory: allreduce by peer reads
  // through CUDA IPC (peer_allreduce.h) where every local rank can map the others' memory. Off: staged.
  bool peer_path = true;
  size_t peer_chunk_bytes = size_t(64) << 20;  // the peer path's passes; each rank's block holds two
  bool force_peer = false;  // host buffers stand in for device memory on the peer path (tests its logic on CPU)
  // Named operations pair across ranks by name, in any order (Horovod's rule; pycomm.horovod turns it
  // on): one that some rank has not submitted waits aside without holding up the operations behind
  // it (coordinator.h). Off: every operation pairs by submission order.
  bool pair_by_name = false;
  // Measured choices for "auto" (pycomm-tune): messages up to .first bytes use
  // .second; sorted by size. Empty: the built-in rule (choose_auto, allreduce_catalogue.h).
  AutoTable auto_table;
};

struct AllreduceArgs {
  Buffer input;
  Buffer output;  // == input for in-place
  ReduceOp op = ReduceOp::SUM;
  bool average = false;
  Algorithm algorithm = Algorithm::AUTO;
  std::string name;
  // The tensor's shape, compared between ranks: the same element count in another shape is an error
  // (Horovod's rule). Empty: compared as a flat buffer of input.count elements (torch's c10d).
  // Read at submission only: Engine::allreduce_op moves it into the operation's signature.
  std::vector<int64_t> shape;
};

// Reduce-scatter: `input` (shape `shape`) is cut into N segments,
// segment j = elements [segments[j], segments[j+1]); rank r receives the
// reduction of segment r in `output`. `input` is not modified.
struct ReduceScatterArgs {
  Buffer input;
  Buffer output;
  std::vector<size_t> segments;  // N+1 element offsets
  std::vector<int64_t> shape;
  ReduceOp op = ReduceOp::SUM;
  bool average = false;
  Algorithm algorithm = Algorithm::AUTO;  // auto | ring | mpi
  std::string name;
};

// Alltoall of rows of `row_elems` elements: `send_rows[j]` rows of `input` (in
// rank order) go to rank j. `recv_rows` empty: the counts are exchanged and
// `allocate(total_rows)` (engine thread) returns the output; else the output
// is `output`, and counts that do not match the senders' raise on every rank.
struct AlltoallArgs {
  Buffer input;
  size_t row_elems = 1;
  std::vector<int64_t> row_shape;
  std::vector<size_t> send_rows;
  std::vector<size_t> recv_rows;
  void* output = nullptr;
  std::function<void*(size_t)> allocate;
  std::string name;
};

// Counters for tests, benchmarks and stall reports.
struct EngineStats {
  uint64_t operations = 0;   // operations completed
  uint64_t rounds = 0;       // coordination rounds (fused batches count once)
  uint64_t fused_tensors = 0;  // allreduces that ran inside a fused batch of two or more
  uint64_t waiter_batches = 0;  // batches a waiting caller ran on its own thread (Engine::run_queued_for)
  // Memory the engine holds between operations (as of the last one that ended).
  uint64_t shm_allocations = 0;      // collective (re)allocations of the shared window
  uint64_t shm_segment_bytes = 0;    // this rank's segment of the shared window
  uint64_t fusion_buffer_bytes = 0;  // the host fusion buffer (paths without a shared window)
  uint64_t staging_bytes = 0;        // the two staging chunks (device data, or forced staging)
  // Working memory the movers keep for device-direct algorithms (host stand-in included), and how
  // many blocks they have allocated for it (MemoryMover::working_memory).
  uint64_t device_cache_bytes = 0;
  uint64_t device_cache_allocations = 0;
  // The compressed allreduce's working memory the movers keep (MemoryMover::compressed_memory; host
  // tensors' in the host mover), and how many blocks they have allocated for it.
  uint64_t compressed_cache_bytes = 0;
  uint64_t compressed_cache_allocations = 0;
  // The movers' cached device fusion buffers (device tensors and the host stand-ins), and how many
  // blocks they have allocated for them (MemoryMover::fusion_memory).
  uint64_t device_fusion_bytes = 0;
  uint64_t device_fusion_allocations = 0;
  // The peer path's blocks (two halves of this rank's, peer_allreduce.h), their collective
  // (re)allocations, and the allreduces that took it.
  uint64_t peer_block_bytes = 0;
  uint64_t peer_allocations = 0;
  uint64_t peer_allreduces = 0;
  uint64_t ready_waits = 0;  // operations whose producer event the engine waited on
  uint64_t done_events = 0;  // completion events the engine recorded after its device work
};

}  // namespace comm
}  // namespace pycomm
