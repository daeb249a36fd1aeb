// Engine operations beyond allreduce/broadcast/allgather: reduce_scatter and
// alltoall. Each is one coordinated, non-fused operation on the engine thread
// (the ranks agree on kind, dtype, shape, op and algorithm first). Device
// memory travels through one host copy each way.
#include <cstring>

#include "../kernels/reduce.h"
#include "algorithms.h"
#include "engine.h"
#include "memory_mover.h"

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

WorkPtr Engine::reduce_scatter(const ReduceScatterArgs& args, std::shared_ptr<void> keepalive, bool blocking) {
  const int n = topo_.size, r = topo_.rank;
  if (args.segments.size() != static_cast<size_t>(n) + 1 || args.segments.front() != 0 ||
      args.segments.back() != args.input.count)
    throw CommError("reduce_scatter: the segment table must have size+1 offsets from 0 to the input's length");
  if (args.output.count != args.segments[r + 1] - args.segments[r] || args.output.dtype != args.input.dtype)
    throw CommError("reduce_scatter: the output must hold this rank's segment (" +
                    std::to_string(args.segments[r + 1] - args.segments[r]) + " elements of the input's dtype)");
  if (args.algorithm != Algorithm::AUTO && args.algorithm != Algorithm::RING && args.algorithm != Algorithm::MPI)
    throw CommError(std::string("reduce_scatter: algorithm '") + algorithm_name(args.algorithm) +
                    "' is an allreduce algorithm; choose auto, ring or mpi");
  Signature sig = Signature::of(Collective::REDUCE_SCATTER, args.input, args.shape, args.name);
  sig.op = static_cast<int32_t>(args.op);
  sig.extra = args.average ? 1 : 0;
  sig.algorithm = static_cast<int32_t>(args.algorithm);
  return submit_custom(sig, "reduce_scatter " + args.name, std::move(keepalive), [this, args] {
    const Buffer& in = args.input;
    const size_t esize = kernels::dtype_size(in.dtype);
    const bool device = in.device != Device::CPU;
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
  }, blocking);
}

WorkPtr Engine::alltoall(const AlltoallArgs& args, std::shared_ptr<void> keepalive, bool blocking) {
  const int n = topo_.size;
  if (args.send_rows.size() != static_cast<size_t>(n))
    throw CommError("alltoall: give one send count per rank (" + std::to_string(n) + ")");
  if (!args.recv_rows.empty() && args.recv_rows.size() != static_cast<size_t>(n))
    throw CommError("alltoall: give one receive count per rank (" + std::to_string(n) + ")");
  size_t rows = 0;
  for (size_t c : args.send_rows) rows += c;
  if (rows * args.row_elems != args.input.count)
    throw CommError("alltoall: the send counts add up to " + std::to_string(rows) + " rows but the input has " +
                    std::to_string(args.row_elems ? args.input.count / args.row_elems : 0));
  std::vector<int64_t> shape{0};
  shape.insert(shape.end(), args.row_shape.begin(), args.row_shape.end());
  Signature sig = Signature::of(Collective::ALLTOALL, args.input, shape, args.name);
  sig.numel = -1;  // rows differ per rank
  return submit_custom(sig, "alltoall " + args.name, std::move(keepalive), [this, args] {
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
    if (args.input.device == Device::CPU) {
      PairwiseAlltoall(topo_.world).run(static_cast<const char*>(args.input.data), soff, sbytes,
                                        static_cast<char*>(out), roff, rbytes);
      return;
    }
    MemoryMover& mover = mover_for(args.input);  // device memory through host copies
    std::vector<char> hs(s * row_bytes), hr(t * row_bytes);
    copy_to_host(mover, hs.data(), args.input.data, hs.size());
    PairwiseAlltoall(topo_.world).run(hs.data(), soff, sbytes, hr.data(), roff, rbytes);
    copy_to_device(mover, out, hr.data(), hr.size());
  }, blocking);
}

}  // namespace comm
}  // namespace pycomm
