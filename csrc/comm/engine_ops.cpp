// Engine operations beyond allreduce/broadcast/allgather: reduce_scatter,
// alltoall and the compressed allreduce. Each is one coordinated, non-fused
// operation on the engine thread (the ranks agree on kind, dtype, shape, op and
// algorithm first). reduce_scatter and alltoall move device memory through one
// host copy each way; the compressed allreduce picks its form (flat or
// hierarchical, host or device memory) and runs it from compressed_allreduce.h.
#include <cstring>

#include "../kernels/reduce.h"
#include "algorithms.h"
#include "compressed_allreduce.h"
#include "device_ops.h"
#include "engine.h"
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

WorkPtr Engine::compressed_allreduce(const CompressedArgs& args, std::shared_ptr<void> keepalive, bool blocking) {
  // Everything on the input's device: a compressed allreduce never moves a
  // tensor or its state to other memory behind the caller's back.
  auto where = [](const Buffer& b) {
    return b.device == Device::CPU ? std::string("the host") : "cuda:" + std::to_string(b.device_index);
  };
  auto same_device = [&](const Buffer& b) {
    return b.device == args.input.device && (b.device == Device::CPU || b.device_index == args.input.device_index);
  };
  if (args.input.dtype != DType::F32 || args.output.dtype != DType::F32 || args.input.count != args.output.count)
    throw CommError("compressed allreduce: input and output must be float32 buffers of the same size");
  if (!same_device(args.output))
    throw CommError("compressed allreduce of '" + args.name + "': the input is on " + where(args.input) +
                    ", out on " + where(args.output) + "; pass out on the input's device");
  if (args.compression == Compression::ONEBIT) {
    const OneBitLayout L = onebit_layout(args.input.count, topo_.size);
    const std::string dev = where(args.input);
    if (args.worker_residual.dtype != DType::F32 || args.worker_residual.count != L.n ||
        !same_device(args.worker_residual))
      throw CommError("compressed allreduce: the worker residual must be a float32 buffer of " +
                      std::to_string(L.n) + " elements on " + dev + " (the tensor's device)");
    if (args.server_residual.dtype != DType::F32 || args.server_residual.count != L.chunk ||
        !same_device(args.server_residual))
      throw CommError("compressed allreduce: the server residual must be a float32 buffer of " +
                      std::to_string(L.chunk) + " elements at " + std::to_string(topo_.size) + " ranks on " + dev +
                      " (the tensor's device)");
    if (args.mask.data && (args.mask.count != L.n || !same_device(args.mask)))
      throw CommError("compressed allreduce: the mask must be a buffer of " + std::to_string(L.n) + " bytes on " +
                      dev + " (the tensor's device)");
  }

  // The agreement check compares the compression too: it leads the name
  // ("onebit+mask:grad.w"), which the disagreement message shows.
  Signature sig;
  sig.kind = static_cast<int32_t>(Collective::ALLREDUCE);
  sig.dtype = static_cast<int32_t>(args.input.dtype);
  sig.device = static_cast<int32_t>(args.input.device);
  sig.numel = static_cast<int64_t>(args.input.count);
  sig.ndim = 1;
  sig.dims[0] = sig.numel;
  sig.op = static_cast<int32_t>(ReduceOp::SUM);
  sig.extra = args.average ? 1 : 0;
  std::string tag = compression_name(args.compression);
  if (args.mask.data) tag += "+mask";
  sig.set_name(tag + ":" + args.name);

  // Across nodes of equal size with several ranks each, only the cross-node
  // stage is compressed (hierarchical form); otherwise the flat form over all ranks.
  // Device memory (and host memory forced onto a device path) takes the
  // device forms of both, whose kernels run on the tensor's memory.
  const bool across_nodes = topo_.num_nodes > 1 && homogeneous_ && topo_.local_size > 1;
  return submit_custom(sig, "allreduce " + tag + " " + args.name, std::move(keepalive), [this, args, across_nodes] {
    CompressedStats st;
    // force_staging / force_device_direct choose the path; else device memory goes direct when MPI can read it.
    const bool device = args.input.device != Device::CPU;
    const bool direct = active_.force_device_direct || (device && cuda_aware_ && !active_.force_staging);
    if (direct) check_direct(args.input, "compressed allreduce of '" + args.name + "'");
    if (direct || device || active_.force_staging) {
      DeviceOps& ops = device ? cuda_device_ops(args.input.device_index) : cpu_device_ops();
      MemoryMover& mover = mover_for(args.input);
      DeviceWire wire{mover,   direct, *staging_, active_.staging_chunk_bytes, active_.ring_chunk_bytes,
                      this,    mover.cache_limit()};
      if (across_nodes)  // staged: the node's float32 sum in the host window
        device_hierarchical_compressed_allreduce(args, topo_, ops, wire, direct ? nullptr : &shm(), &st);
      else
        device_compressed_allreduce(args, topo_.world, ops, wire, &st);
    } else if (across_nodes)
      hierarchical_compressed_allreduce(args, topo_, shm(), active_.shm_chunk_bytes, &st);
    else if (args.compression == Compression::ONEBIT)
      onebit_compressed_allreduce(args, topo_.world, &st);
    else
      half_compressed_allreduce(args, topo_.world, active_.ring_chunk_bytes, &st);
    if (args.stats) *args.stats = st;
  }, blocking);
}

}  // namespace comm
}  // namespace pycomm
