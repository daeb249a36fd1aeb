// The engine's executor: runs the data side of one agreed operation, on the
// engine thread. The Engine (engine.h) decides what runs and when: the queue,
// the coordination rounds, fusion batches and join. The executor decides how:
//   - an allreduce's path, by memory: host memory to the host algorithms;
//     device memory to a CUDA-aware MPI (device pointers, device reductions),
//     or else staged through two pinned host chunks; then its algorithm, from
//     the catalogue (allreduce_catalogue.h) under the running options;
//   - a fused batch: reduced in place in the node's shm window, packed into the
//     host fusion buffer, or packed into the mover's device fusion buffer;
//   - the other collectives (executor_ops.cpp), on the same paths.
// It owns the memory operations reuse: the shm window, the host fusion buffer,
// the memory movers (one per CUDA device, one host stand-in) and the staging chunks.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "allreduce_catalogue.h"
#include "common.h"
#include "operations.h"

namespace pycomm {
namespace comm {

class ShmWindow;
class MemoryMover;
class PeerAllreduce;
struct StagingBuffers;
struct CompressedArgs;

// Where a buffer's data meets MPI, one rule for every collective (Executor::path_of):
//   HOST    host memory, handed to MPI as it is;
//   DIRECT  device pointers handed to a CUDA-aware MPI, reductions on the device;
//   STAGED  device memory moved through host memory (pinned chunks or one copy each way).
//           An allreduce under "auto" on this path goes by peer reads inside the node instead
//           (the peer path, peer_allreduce.h) where every local rank can map the others' memory.
// force_device_direct, force_peer and force_staging put host memory on DIRECT or STAGED
// (force_peer: the peer path), standing in for device memory, so CPU CI runs the device
// paths' control flow (force_device_direct wins).
enum class MemoryPath { HOST, DIRECT, STAGED };

class Executor {
 public:
  // `active`: the running operation's options, which the Engine sets before each operation.
  Executor(const Topology& topo, bool homogeneous, const EngineOptions& active);
  ~Executor();  // collective over the node when it holds the shm window: every rank's engine shuts down
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // This job's shape, as the allreduce catalogue's rules read it.
  JobShape job_shape() const;
  // The algorithm `requested` ("auto" or a name) means for `bytes` on this topology under `o`. Any thread.
  Algorithm resolve(Algorithm requested, size_t bytes, const EngineOptions& o) const;
  // The path of memory on `device` under the running options (MemoryPath above).
  MemoryPath path_of(Device device) const;

  // The ranks that have joined (pycomm.join), which the Engine sets before each operation: the peer
  // path runs only while none has, since a joined rank answers with host memory.
  void set_joined(int joined) { joined_ = joined; }
  // The peer path's verdict: "" not probed yet (the first allreduce that could take it probes),
  // "peer: <memory kind>", or "staged: <why not>". Any thread.
  std::string peer_verdict() const;

  // Whether `args` runs on the peer path, already probed: its memory is read only on the device, so
  // its producer's event needs no host wait. Engine thread.
  bool on_peer_path(const AllreduceArgs& args) const;

  // ---- operations, on the engine thread, after the coordination round
  // One allreduce: the path by memory, then the algorithm.
  void allreduce(const AllreduceArgs& args);
  // A fused batch of compatible allreduces (the same dtype, op, average and algorithm), in batch
  // order, as one allreduce over their concatenation.
  void fused_allreduce(const std::vector<const AllreduceArgs*>& batch);
  void broadcast(const Buffer& buf, int root);
  // Bytes per MPI_Bcast of a STAGED broadcast: a joined rank answers with the same messages
  // (engine_join.cpp).
  size_t staged_broadcast_chunk() const;
  void allgather(const Buffer& send, size_t rows, size_t row_bytes, const std::function<void*(size_t)>& allocate);
  void reduce_scatter(const ReduceScatterArgs& args);
  void alltoall(const AlltoallArgs& args);
  void compressed_allreduce(const CompressedArgs& args);  // compressed_allreduce.h

  // ---- memory
  // The mover for a buffer's memory (CUDA streams, or host lanes for the stand-ins). Any thread.
  MemoryMover& mover_for(const Buffer& buf);
  // The mover of CUDA device `device`, or the host mover for device < 0 (a DeviceEvent's device).
  MemoryMover& mover_of_device(int device);
  // The two lane streams of CUDA device `device`'s mover (cudaStream_t), made if need be. Any thread.
  std::pair<void*, void*> device_lanes(int device);
  // Device memory about to go to MPI directly: raise direct_path_refusal()'s reason, if any
  // (memory_mover.h). Runs after the coordination round, where every rank has agreed on the
  // buffer's device and options, so every rank raises alike before any data moves.
  void check_direct(const Buffer& buf, const std::string& what) const;
  ShmWindow& shm();
  // The memory fields of `stats`: what the window, the buffers, the movers and the compressed
  // allreduce's device workspaces hold now.
  void memory_stats(EngineStats* stats);

 private:
  // The catalogue entry of `a`, or CommError with the reason it cannot run on this job.
  const AllreduceAlgorithm& checked_algorithm(Algorithm a) const;
  // What an algorithm may use for one call (device: the buffer's mover, or null).
  AllreduceRun allreduce_run(MemoryMover* device);
  void device_allreduce(const AllreduceArgs& args);
  // Why this job's shape has no peer path ("" when it may have one).
  std::string peer_shape_refusal() const;
  // Whether the peer path may take `args` (before the probe's verdict).
  bool peer_applies(const AllreduceArgs& args) const;
  // The peer path for `args` (probed on first use, agreed by every rank), or null: staged.
  PeerAllreduce* peer_for(const AllreduceArgs& args);
  void staged_allreduce(const AllreduceArgs& args);
  void host_allreduce(const AllreduceArgs& args);
  void staged_broadcast(const Buffer& buf, int root);
  // executor.cpp: fusion of device tensors (and of the host stand-ins) in the mover's fusion buffer.
  bool device_fusion(const AllreduceArgs& head) const;
  void device_fused_allreduce(const std::vector<const AllreduceArgs*>& batch);
  // The one allreduce of a fused batch over `total` elements at `flat`: an average of float32/64
  // is summed and its 1/N returned in *unpack_scale, to fuse into the unpack (fp16/bf16 keep the
  // pre-division of the allreduce itself, since their sums overflow).
  AllreduceArgs fused_args(const AllreduceArgs& head, void* flat, size_t total, double* unpack_scale) const;

  const Topology& topo_;
  const bool homogeneous_;
  const EngineOptions& active_;
  bool cuda_aware_ = false;
  std::unique_ptr<ShmWindow> shm_;
  std::vector<char> fusion_buffer_;
  std::unique_ptr<MemoryMover> host_mover_;
  std::vector<std::unique_ptr<MemoryMover>> cuda_movers_;  // by device index
  std::mutex movers_mu_;  // creation of movers: the engine thread and submitters (device_lanes)
  std::unique_ptr<StagingBuffers> staging_;
  std::unique_ptr<PeerAllreduce> peer_;  // after the movers: destroyed first
  bool peer_probed_ = false;
  std::string peer_refusal_;
  mutable std::mutex peer_mu_;  // peer_probed_ and peer_refusal_, read by stats from any thread
  uint64_t peer_allreduces_ = 0;
  int joined_ = 0;
};

}  // namespace comm
}  // namespace pycomm
