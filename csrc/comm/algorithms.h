// The collective algorithms. Each runs synchronously on the calling thread
// (the engine's worker) over one communicator. Host memory unless a function
// takes a MemoryMover, which then holds the device buffer (CUDA-aware MPI).
// Which allreduce runs for a call is decided in allreduce_catalogue.cpp.
#pragma once
#include <mpi.h>

#include <functional>
#include <vector>

#include "common.h"
#include "memory_mover.h"

namespace pycomm {
namespace comm {

// Ring allreduce: reduce-scatter then allgather, 2(N-1) steps of S/N bytes.
// Each step is cut into chunks of `chunk_bytes`; a chunk is forwarded as soon
// as it has been received (and reduced), so receive, reduce and send overlap.
// Cost: 2(N-1) alpha + 2(N-1)/N S beta + (N-1)/N S gamma.
// `memory`: where the buffer lives, for buffers MPI reads directly on a device
// (CUDA-aware MPI): receive slots and reductions come from it (reductions then
// run on the GPU). nullptr: host memory.
void ring_allreduce(const Buffer& buf, ReduceOp op, MPI_Comm comm, size_t chunk_bytes,
                    MemoryMover* memory = nullptr);

// MPI's own MPI_Allreduce(MPI_IN_PLACE, ...): the baseline, and the choice for small messages.
void mpi_allreduce(const Buffer& buf, ReduceOp op, MPI_Comm comm);

// MPI_Bcast from `root`, split into pieces whose counts fit an int.
void broadcast(const Buffer& buf, int root, MPI_Comm comm);

// Gather every rank's `rows` rows of `row_bytes` each (row counts may differ per
// rank) into one buffer in rank order. `allocate(total_rows)` is called once
// and returns the output memory. Returns the per-rank row counts.
std::vector<size_t> allgatherv(const void* send, size_t rows, size_t row_bytes, MPI_Comm comm,
                               const std::function<void*(size_t)>& allocate);

// The reduce-scatter half of the ring allreduce, in place on `buf`: segment j is
// [segments[j], segments[j+1]) (N+1 offsets in elements); afterwards rank r's
// segment r of `buf` holds the reduction over all ranks (other segments hold
// partial sums). Host memory. Defined in ring_allreduce.cpp.
// `memory`: as for ring_allreduce (device buffers under a CUDA-aware MPI).
void ring_reduce_scatter_inplace(const Buffer& buf, const std::vector<size_t>& segments, ReduceOp op, MPI_Comm comm,
                                 size_t chunk_bytes, MemoryMover* memory = nullptr);

// Reduce-scatter algorithms (reduce_scatter.cpp). `input` holds every rank's
// full vector of segments (segment j = [segments[j], segments[j+1]) in
// elements); rank r receives the reduction of segment r in `output`. `input`
// is left unchanged. Host memory.
class RingReduceScatter {
 public:
  RingReduceScatter(MPI_Comm comm, size_t chunk_bytes) : comm_(comm), chunk_bytes_(chunk_bytes) {}
  void run(const Buffer& input, void* output, const std::vector<size_t>& segments, ReduceOp op);

 private:
  MPI_Comm comm_;
  size_t chunk_bytes_;
};

class MpiReduceScatter {
 public:
  explicit MpiReduceScatter(MPI_Comm comm) : comm_(comm) {}
  void run(const Buffer& input, void* output, const std::vector<size_t>& segments, ReduceOp op);

 private:
  MPI_Comm comm_;
};

// Alltoall (alltoall.cpp): rank r sends send_bytes[j] bytes from
// send + send_offset[j] to rank j, and receives recv_bytes[j] bytes from rank j
// at recv + recv_offset[j]. Host memory.
class PairwiseAlltoall {
 public:
  explicit PairwiseAlltoall(MPI_Comm comm) : comm_(comm) {}
  void run(const char* send, const std::vector<size_t>& send_offset, const std::vector<size_t>& send_bytes, char* recv,
           const std::vector<size_t>& recv_offset, const std::vector<size_t>& recv_bytes);

 private:
  MPI_Comm comm_;
};

}  // namespace comm
}  // namespace pycomm

namespace pycomm {
namespace comm {

class ShmWindow;

// Tensors fused into one allreduce (same dtype), packed back to back in order.
struct FusedTensors {
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  std::vector<size_t> counts;
  DType dtype = DType::F32;
  int world_size = 1;
};

// Fused allreduce whose fusion buffer is this rank's shared-memory segment:
// packing is the copy-in and unpacking the copy-out, so fusing costs no extra
// pass over memory. With `cross` (one node's shard ring across nodes) it is
// the hierarchical allreduce; with MPI_COMM_NULL the one-node shm allreduce.
// `pre_divide` scales by 1/N before reducing (fp16/bf16 averages);
// `unpack_scale` is applied on the way out (1/N for other averages).
// On one node, batches above shm_pipeline_min_bytes run chunk by chunk as shm_allreduce does, the
// packing and unpacking being each chunk's copies; below, in one pass whose own slice is reduced in
// place in the result tensors as shm_allreduce's is (only the other (L-1)/L is packed and unpacked).
void windowed_fused_allreduce(const FusedTensors& tensors, ReduceOp op, bool pre_divide, double unpack_scale,
                              ShmWindow& shm, MPI_Comm cross, size_t chunk_bytes, size_t shm_chunk_bytes = 0);

// Intra-node allreduce through a shared-memory window. Per rank, with L ranks
// on the node and S bytes: copy into its segment the (L-1)/L of the message
// that the peers reduce, fence, reduce its own 1/L slice where it lies in the
// tensor from the L-1 peers' segments (read 2(L-1)/L S, write (L-1)/L S) and
// copy the result into its segment, fence, copy the peers' L-1 reduced slices
// out ((L-1)/L S), fence: S copied in and (L-1)/L S out. Up to
// kShmOneFenceBytes: one barrier, each rank reducing the whole message
// (write S, read L S, reduce (L-1) S).
//
// Above `chunk_bytes` (and chunk_bytes > 0) the same three steps run chunk by
// chunk through two halves of a 2 x chunk_bytes window, so the window stays
// in the last-level cache and only the tensor itself travels to and from
// DRAM: per chunk, copy in the (L-1)/L of it that the peers reduce, fence,
// reduce this rank's own 1/L slice where it lies in the tensor (from the L-1
// peers' segments) and copy the result into the window, fence, copy the
// peers' L-1 reduced slices out. Copying chunk c out and chunk c+1 in are
// one phase: chunk c+2 reuses chunk c's half only after the fence that
// follows chunk c+1's copy-in, which every rank reaches after its copy-out
// of chunk c. 2 ceil(S / chunk_bytes) + 1 barriers; DRAM traffic per rank
// about 2 S (read the tensor, write it back) instead of 2 S + 5 (L-1)/L S
// for a window the size of the message. The chunk size must be the same on every
// rank (an engine option, agreed like the others). Chunked only where the
// one-pass form's working set, L tensors and L segments of S, exceeds the
// last-level cache: below that the one pass runs from cache and its fewer
// barriers win (bench/shm_chunk.py).
constexpr size_t kShmOneFenceBytes = size_t(32) << 10;
void shm_allreduce(const Buffer& buf, ReduceOp op, ShmWindow& shm, size_t chunk_bytes = 0);
// The smallest message shm_allreduce runs chunk by chunk on a node of `local_size` ranks:
// above chunk_bytes and above min(last-level cache, 32 MiB) / (2 local_size). The same on every rank of a node.
size_t shm_pipeline_min_bytes(int local_size, size_t chunk_bytes);

// Hierarchical allreduce over M nodes x L ranks (Horovod's form): intra-node
// reduce-scatter through shared memory, then L concurrent inter-node
// allreduces, one per local rank on its 1/L shard over `cross`, then the
// intra-node allgather. Slow-link latency 2(M-1) alpha instead of 2(N-1) alpha.
// `cross_ring` picks pycomm's ring (true) or MPI_Allreduce (false) between nodes.
void hierarchical_allreduce(const Buffer& buf, ReduceOp op, ShmWindow& shm, MPI_Comm cross, bool cross_ring,
                            size_t chunk_bytes);

// Hierarchical allreduce on device memory handed straight to a CUDA-aware MPI
// (no host shared memory on that path), all point-to-point:
//   1. ring reduce-scatter among the node's L ranks over `local` (receive
//      slots and reductions on the device): local rank l holds slice l of the
//      node's reduction, about S/L bytes;
//   2. ring allreduce of slice l among the M ranks with local rank l (`cross`);
//   3. allgather of the L slices inside the node (MPI_Allgatherv in place).
// Bytes each rank sends: inside the node 2 (L-1)/L S, across nodes
// 2 (M-1)/M S/L -- the host form's cross-node traffic, with the node stages
// moving over the GPUs' own links instead of host memory.
void device_hierarchical_allreduce(const Buffer& buf, ReduceOp op, MPI_Comm local, MPI_Comm cross, size_t chunk_bytes,
                                   MemoryMover& memory);

// Group-master form (Jia et al. 2018): reduce inside the node to local rank 0,
// allreduce among the node masters over `masters` (the cross communicator of
// local rank 0; MPI_COMM_NULL elsewhere), broadcast inside the node. Only the
// masters use the inter-node link, each carrying the whole S.
void hierarchical_master_allreduce(const Buffer& buf, ReduceOp op, ShmWindow& shm, MPI_Comm masters,
                                   bool cross_ring, size_t chunk_bytes);

}  // namespace comm
}  // namespace pycomm
