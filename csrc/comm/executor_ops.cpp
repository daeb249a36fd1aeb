// The executor's collectives beyond allreduce (executor.h): broadcast, allgather,
// reduce_scatter, alltoall and the compressed allreduce, each run on the engine
// thread after its coordination round, on its buffer's MemoryPath (executor.h):
// HOST memory goes to MPI as it is; DIRECT device memory to a CUDA-aware MPI,
// except reduce_scatter and alltoall, which work on host memory; STAGED device
// memory through host copies: broadcast in the double-buffered staging chunks,
// the others in one host copy each way. The compressed allreduce picks its form
// (flat or hierarchical, host or device memory) and runs it from compressed_allreduce.h.
#include <cstring>

#include "../kernels/reduce.h"
#include "algorithms.h"
#include "compressed_allreduce.h"
#include "device_ops.h"
#include "executor.h"
#include "memory_mover.h"
#include "shm_window.h"
#include "staging.h"

namespace pycomm {
namespace comm {
namespace {

void copy_to_host(MemoryMover& mover, void* host, const void* device, size_t bytes) {
  if (!bytes) return;
  mover.to_host_async(host, device, bytes, 0);
  mover.wait_lane(0);
}

void copy_to_device(MemoryMover& mover, void* device, const void* host, size_t bytes) {
  if (!bytes) return;
  mover.to_device_async(device, host, bytes, 0);
  mover.wait_lane(0);
}

}  // namespace

// Bytes per MPI_Bcast of a staged broadcast.
size_t Executor::staged_broadcast_chunk() const {
  return std::max<size_t>(1, std::min(active_.staging_chunk_bytes, size_t(1) << 30));
}

void Executor::broadcast(const Buffer& buf, int root) {
  if (topo_.size == 1 || buf.count == 0) return;
  if (path_of(buf.device) == MemoryPath::STAGED) return staged_broadcast(buf, root);
  check_direct(buf, "broadcast");
  comm::broadcast(buf, root, topo_.world);
}

// Device memory without a CUDA-aware MPI: through the two cached pinned staging chunks, double-
// buffered as in staged_allreduce (staging.h). Chunk k (staging_chunk_bytes): the root copies it down
// on lane k % 2 while chunk k-1 is broadcast; the others broadcast into the host chunk and copy it up
// on lane k % 2. The host waits per chunk, for the copy MPI reads next (root) or the upload whose
// buffer it reuses (others); the last uploads are ordered by the done event. Bytes per rank: S down
// (root) or S up (others), S over MPI.
void Executor::staged_broadcast(const Buffer& buf, int root) {
  MemoryMover& mover = mover_for(buf);
  const size_t bytes = buf.bytes();
  const size_t chunk = staged_broadcast_chunk();
  const size_t chunks = (bytes + chunk - 1) / chunk;
  const bool is_root = topo_.rank == root;
  staging_->reserve(mover, std::min(bytes, chunk));
  char* base = static_cast<char*>(buf.data);
  auto len_of = [&](size_t k) { return std::min(chunk, bytes - k * chunk); };
  if (is_root) mover.to_host_async(staging_->chunk[0], base, len_of(0), 0);
  for (size_t k = 0; k < chunks; ++k) {
    const int lane = static_cast<int>(k % 2);
    mover.wait_lane(lane);
    if (is_root && k + 1 < chunks)
      mover.to_host_async(staging_->chunk[1 - lane], base + (k + 1) * chunk, len_of(k + 1), 1 - lane);
    PYCOMM_MPI_CHECK(MPI_Bcast(staging_->chunk[lane], static_cast<int>(len_of(k)), MPI_BYTE, root, topo_.world));
    if (!is_root) mover.to_device_async(base + k * chunk, staging_->chunk[lane], len_of(k), lane);
  }
  mover.join_lanes();
}

void Executor::allgather(const Buffer& send, size_t rows, size_t row_bytes,
                         const std::function<void*(size_t)>& allocate) {
  if (path_of(send.device) != MemoryPath::STAGED) {
    check_direct(send, "allgather");
    allgatherv(send.data, rows, row_bytes, topo_.world, allocate);
    return;
  }
  MemoryMover& mover = mover_for(send);  // device memory through host copies
  std::vector<char> mine(rows * row_bytes), all;
  copy_to_host(mover, mine.data(), send.data, mine.size());
  void* device_out = nullptr;
  allgatherv(mine.data(), rows, row_bytes, topo_.world, [&](size_t total_rows) -> void* {
    device_out = allocate(total_rows);
    all.resize(total_rows * row_bytes);
    return all.data();
  });
  copy_to_device(mover, device_out, all.data(), all.size());
}

void Executor::reduce_scatter(const ReduceScatterArgs& args) {
  const Buffer& in = args.input;
  const size_t esize = kernels::dtype_size(in.dtype);
  const bool device = path_of(in.device) != MemoryPath::HOST;  // host reductions: device memory is copied
  const AverageRule avg = AverageRule::of(args.average, in.dtype, topo_.size);
  // Host views: device data and inputs divided before the sum use a host copy.
  std::vector<char> host_in, host_out;
  Buffer hin = in;
  void* hout = args.output.data;
  if (device || avg.before != 1.0) {
    host_in.resize(in.bytes());
    if (device) copy_to_host(mover_for(in), host_in.data(), in.data, in.bytes());
    else if (in.count) std::memcpy(host_in.data(), in.data, in.bytes());
    hin.data = host_in.data();
    hin.device = Device::CPU;
    if (avg.before != 1.0) kernels::scale_cpu(hin.data, hin.count, hin.dtype, avg.before);
  }
  if (device) {
    host_out.resize(args.output.bytes());
    hout = host_out.data();
  }
  Algorithm algo = args.algorithm;
  if (algo == Algorithm::AUTO) algo = in.bytes() < active_.auto_ring_min_bytes ? Algorithm::MPI : Algorithm::RING;
  if (algo == Algorithm::MPI && topo_.size > 1) MpiReduceScatter(topo_.world).run(hin, hout, args.segments, args.op);
  else RingReduceScatter(topo_.world, active_.ring_chunk_bytes).run(hin, hout, args.segments, args.op);
  if (avg.after != 1.0) kernels::scale_cpu(hout, args.output.count, args.output.dtype, avg.after);
  if (device) copy_to_device(mover_for(args.output), args.output.data, hout, args.output.count * esize);
}

void Executor::alltoall(const AlltoallArgs& args) {
  const int size = topo_.size, rank = topo_.rank;
  const size_t row_bytes = args.row_elems * kernels::dtype_size(args.input.dtype);
  // Every rank learns how many rows each peer sends it.
  std::vector<uint64_t> mine(args.send_rows.begin(), args.send_rows.end()), theirs(static_cast<size_t>(size));
  PYCOMM_MPI_CHECK(MPI_Alltoall(mine.data(), 1, MPI_UINT64_T, theirs.data(), 1, MPI_UINT64_T, topo_.world));
  if (!args.recv_rows.empty()) {
    // The given receive counts must match what the peers send: agree on it so every rank raises.
    int bad = 0, any_bad = 0;
    for (int j = 0; j < size; ++j) bad |= theirs[j] != args.recv_rows[j];
    PYCOMM_MPI_CHECK(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, topo_.world));
    if (any_bad) {
      std::string detail;
      if (bad)
        for (int j = 0; j < size; ++j)
          if (theirs[j] != args.recv_rows[j])
            detail = "; rank " + std::to_string(rank) + " expects " + std::to_string(args.recv_rows[j]) +
                     " rows from rank " + std::to_string(j) + ", which sends " + std::to_string(theirs[j]);
      throw CommError("alltoall: output split sizes do not match the input split sizes of the sending ranks" +
                      detail);
    }
  }
  std::vector<size_t> soff(size), sbytes(size), roff(size), rbytes(size);
  size_t s = 0, t = 0;
  for (int j = 0; j < size; ++j) {
    soff[j] = s * row_bytes;
    sbytes[j] = args.send_rows[j] * row_bytes;
    s += args.send_rows[j];
    roff[j] = t * row_bytes;
    rbytes[j] = theirs[j] * row_bytes;
    t += theirs[j];
  }
  void* out = args.recv_rows.empty() ? args.allocate(t) : args.output;  // given receive counts come with the output
  if (path_of(args.input.device) == MemoryPath::HOST) {
    PairwiseAlltoall(topo_.world).run(static_cast<const char*>(args.input.data), soff, sbytes,
                                      static_cast<char*>(out), roff, rbytes);
    return;
  }
  MemoryMover& mover = mover_for(args.input);  // device memory through host copies
  std::vector<char> hs(s * row_bytes), hr(t * row_bytes);
  copy_to_host(mover, hs.data(), args.input.data, hs.size());
  PairwiseAlltoall(topo_.world).run(hs.data(), soff, sbytes, hr.data(), roff, rbytes);
  copy_to_device(mover, out, hr.data(), hr.size());
}

void Executor::compressed_allreduce(const CompressedArgs& args) {
  // Across nodes of equal size with several ranks each, only the cross-node
  // stage is compressed (hierarchical form); otherwise the flat form over all ranks.
  // Device memory (and host memory forced onto a device path) takes the
  // device forms of both, whose kernels run on the tensor's memory.
  const bool across_nodes = topo_.num_nodes > 1 && homogeneous_ && topo_.local_size > 1;
  CompressedStats st;
  const bool device = args.input.device != Device::CPU;
  const MemoryPath path = path_of(args.input.device);
  const bool direct = path == MemoryPath::DIRECT;
  if (direct) check_direct(args.input, "compressed allreduce of '" + args.name + "'");
  // The tensor's mover: its cache holds the working buffers (the host mover's for host memory).
  MemoryMover& mover = mover_for(args.input);
  if (path != MemoryPath::HOST) {
    DeviceOps& ops = device ? cuda_device_ops(args.input.device_index) : cpu_device_ops();
    DeviceWire wire{mover, direct, *staging_, active_.staging_chunk_bytes, active_.ring_chunk_bytes};
    if (across_nodes)  // staged: the node's float32 sum in the host window
      device_hierarchical_compressed_allreduce(args, topo_, ops, wire, direct ? nullptr : &shm(), &st);
    else
      device_compressed_allreduce(args, topo_.world, ops, wire, &st);
  } else if (across_nodes) {
    hierarchical_compressed_allreduce(args, topo_, shm(), active_.shm_chunk_bytes, mover, &st);
  } else if (args.compression == Compression::ONEBIT) {
    onebit_compressed_allreduce(args, topo_.world, mover, &st);
  } else {
    half_compressed_allreduce(args, topo_.world, active_.ring_chunk_bytes, mover, &st);
  }
  if (args.stats) *args.stats = st;
}

}  // namespace comm
}  // namespace pycomm
