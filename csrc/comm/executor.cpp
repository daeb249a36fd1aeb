// The engine's executor (executor.h): an allreduce's path and algorithm, fused
// batches, and the memory both reuse. The other collectives are in executor_ops.cpp.
//
// Fused batch (docs/algorithms.md §1-2; the coordinator makes every rank fuse the
// same tensors in the same order), by where the tensors live:
//   shm window  the algorithm's WindowFusion: each rank's tensors are reduced
//               straight into the node's window and read back (no pack pass);
//   host        pack k tensors -> fusion buffer, one allreduce, unpack;
//   device      pack k tensors -> the mover's fusion buffer (one kernel on the
//               GPU), one allreduce by the device or staged path, unpack.
// The unpack carries the average's 1/N (fp16/bf16 are pre-divided instead, as
// their sums overflow). Bytes: the tensors' bytes once into the buffer and once
// out, which is cached and grown geometrically (MemoryMover::fusion_memory).
#include "executor.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../kernels/fusion.h"
#include "../kernels/reduce.h"
#include "algorithms.h"
#include "memory_mover.h"
#include "peer_allreduce.h"
#include "shm_window.h"
#include "host_mover.h"
#include "staging.h"
#include "timeline.h"

namespace pycomm {
namespace comm {

Executor::Executor(const Topology& topo, bool homogeneous, const EngineOptions& active)
    : topo_(topo), homogeneous_(homogeneous), active_(active), staging_(std::make_unique<StagingBuffers>()) {
  cuda_aware_ = mpi_is_cuda_aware();
}

Executor::~Executor() {
  peer_.reset();     // collective over the node, like the window
  shm_.reset();      // collective over the node: every rank shuts down
  staging_.reset();  // before the movers that own its memory
  cuda_movers_.clear();
  host_mover_.reset();
}

JobShape Executor::job_shape() const {
  return JobShape{topo_.size, topo_.num_nodes, topo_.local_size, homogeneous_};
}

Algorithm Executor::resolve(Algorithm requested, size_t bytes, const EngineOptions& o) const {
  if (requested != Algorithm::AUTO) return requested;
  return choose_auto(bytes, job_shape(), o.auto_ring_min_bytes, o.auto_table);
}

const AllreduceAlgorithm& Executor::checked_algorithm(Algorithm a) const {
  const std::string why = allreduce_refusal(a, job_shape());
  if (!why.empty()) throw CommError(why);
  return allreduce_algorithm(a);
}

AllreduceRun Executor::allreduce_run(MemoryMover* device) {
  return AllreduceRun{topo_, active_.ring_chunk_bytes, active_.shm_chunk_bytes,
                      [this]() -> ShmWindow& { return shm(); }, device};
}

namespace {

// PYCOMM_DEVICE_CACHE_MB: the most working memory a mover keeps between operations (default 256).
size_t device_cache_limit() {
  const char* raw = std::getenv("PYCOMM_DEVICE_CACHE_MB");
  if (!raw || !*raw) return size_t(256) << 20;
  char* end = nullptr;
  unsigned long long mb = std::strtoull(raw, &end, 10);
  if (*end != '\0' || raw[0] == '-')
    throw CommError(std::string("PYCOMM_DEVICE_CACHE_MB=") + raw + " must be a whole number of MiB (0: keep nothing)");
  return static_cast<size_t>(mb) << 20;
}

}  // namespace

std::pair<void*, void*> Executor::device_lanes(int device) {
  Buffer b;
  b.device = Device::CUDA;
  b.device_index = device;
  MemoryMover& m = mover_for(b);
  return {m.lane_stream(0), m.lane_stream(1)};
}

MemoryMover& Executor::mover_for(const Buffer& buf) {
  std::lock_guard<std::mutex> lock(movers_mu_);
  if (buf.device == Device::CPU) {
    if (!host_mover_) {
      host_mover_ = std::make_unique<HostMover>();
      host_mover_->set_cache_limit(device_cache_limit());
    }
    return *host_mover_;
  }
  const size_t d = static_cast<size_t>(std::max(buf.device_index, 0));
  if (cuda_movers_.size() <= d) cuda_movers_.resize(d + 1);
  if (!cuda_movers_[d]) {
    cuda_movers_[d] = make_cuda_mover(static_cast<int>(d));
    cuda_movers_[d]->set_cache_limit(device_cache_limit());
  }
  return *cuda_movers_[d];
}

void Executor::check_direct(const Buffer& buf, const std::string& what) const {
  if (buf.device == Device::CPU) return;  // host memory (the stand-ins included): any MPI reads it
  const std::string why = direct_path_refusal(what, cuda_aware_, active_.force_device_direct, mpi_library_cuda_support(),
                                              std::getenv("PYCOMM_CUDA_AWARE"));
  if (!why.empty()) throw CommError(why);
}

MemoryPath Executor::path_of(Device device) const {
  if (active_.force_device_direct) return MemoryPath::DIRECT;
  if (active_.force_staging || active_.force_peer) return MemoryPath::STAGED;
  if (device == Device::CPU) return MemoryPath::HOST;
  return cuda_aware_ ? MemoryPath::DIRECT : MemoryPath::STAGED;
}

void Executor::allreduce(const AllreduceArgs& a) {
  switch (path_of(a.input.device)) {
    case MemoryPath::DIRECT:
      check_direct(a.input, "allreduce of '" + a.name + "'");
      return device_allreduce(a);
    case MemoryPath::STAGED:
      if (PeerAllreduce* peer = peer_for(a)) {
        const AverageRule avg = AverageRule::of(a.average, a.output.dtype, topo_.size);
        const int device = a.input.device == Device::CPU ? -1 : a.input.device_index;
        peer->run(a.input, a.output, a.op, avg, device, active_.peer_chunk_bytes, mover_for(a.input), *staging_,
                  active_.staging_chunk_bytes, active_.ring_chunk_bytes);
        ++peer_allreduces_;
        return;
      }
      return staged_allreduce(a);
    case MemoryPath::HOST:
      return host_allreduce(a);
  }
}

// Every condition is the same on every rank (the coordination round agreed on the algorithm, the
// options and the memory's kind; joined_ is the round's), and so is the probe's verdict.
std::string Executor::peer_shape_refusal() const {
  if (topo_.size == 1) return "one rank";
  if (!homogeneous_) return "nodes with different numbers of ranks";
  if (topo_.local_size < 2) return "one rank per node: no peers inside a node";
  return std::string();
}

bool Executor::peer_applies(const AllreduceArgs& a) const {
  if (a.algorithm != Algorithm::AUTO || joined_ > 0 || !peer_shape_refusal().empty()) return false;
  if (path_of(a.input.device) != MemoryPath::STAGED) return false;
  return active_.peer_path && (a.input.device != Device::CPU || active_.force_peer);
}

bool Executor::on_peer_path(const AllreduceArgs& a) const { return peer_ && peer_applies(a); }

PeerAllreduce* Executor::peer_for(const AllreduceArgs& a) {
  if (!peer_applies(a)) return nullptr;
  const bool host = a.input.device == Device::CPU;
  if (!peer_probed_) {
    MemoryMover& mover = mover_for(a.input);
    std::string why;
    peer_ = PeerAllreduce::probe(mover.peer_memory(), host ? -1 : a.input.device_index, topo_, &why);
    std::lock_guard<std::mutex> lock(peer_mu_);
    peer_probed_ = true;
    peer_refusal_ = why;
    if (!peer_ && topo_.rank == 0)
      std::fprintf(stderr, "pycomm: device allreduces are staged through host memory: the peer path cannot run (%s); "
                           "said once\n", why.c_str());
  }
  return peer_.get();
}

std::string Executor::peer_verdict() const {
  const std::string shape = peer_shape_refusal();
  if (!shape.empty()) return "staged: " + shape;
  std::lock_guard<std::mutex> lock(peer_mu_);
  if (!peer_probed_) return std::string();
  return peer_ ? std::string("peer: ") + peer_->kind() : "staged: " + peer_refusal_;
}

// Device memory with a CUDA-aware MPI: device pointers go straight to MPI
// (GPUDirect RDMA where the cluster has it) and the reductions run on the GPU.
// There is no host shared-memory window on this path: `auto` replaces an
// algorithm without a device form (shm, hierarchical_master) by the nearest one
// with it (device_substitute); naming one explicitly is an error.
void Executor::device_allreduce(const AllreduceArgs& a) {
  const Buffer& out = a.output;
  Algorithm algo = resolve(a.algorithm, out.bytes(), active_);
  if (a.algorithm == Algorithm::AUTO) algo = device_substitute(algo, out.bytes(), active_.auto_ring_min_bytes);
  const AllreduceAlgorithm& entry = allreduce_algorithm(algo);
  if (!entry.device) {
    std::string names;
    for (const auto& e : allreduce_algorithms())
      if (e.device) names += std::string(names.empty() ? "'" : ", '") + e.name + "'";
    throw CommError(std::string("allreduce algorithm '") + entry.name +
                    "' needs a host shared-memory window; device memory under a CUDA-aware MPI runs " + names);
  }
  checked_algorithm(algo);
  MemoryMover& gpu = mover_for(out);
  gpu.wait_lane(0);  // a fused batch's pack (lane 0) has written the buffer MPI is about to read
  if (out.data != a.input.data && a.input.count) gpu.copy(out.data, a.input.data, a.input.bytes());
  if (out.count == 0 || topo_.size == 1) return;
  const AverageRule avg = AverageRule::of(a.average, out.dtype, topo_.size);
  if (avg.before != 1.0) gpu.scale(out.data, out.count, out.dtype, avg.before);
  entry.device(out, a.op, allreduce_run(&gpu));
  if (avg.after != 1.0) gpu.scale(out.data, out.count, out.dtype, avg.after);
}

// Device memory with an MPI that cannot touch it (or any memory, when forced
// for testing): chunks go down to pinned host buffers, are reduced across
// ranks on the host by the chosen algorithm, and go back up.
void Executor::staged_allreduce(const AllreduceArgs& a) {
  if (a.input.count == 0) return;
  MemoryMover& mover = mover_for(a.input);
  // No host wait for the last uploads: the done event (record_done) and a fused batch's unpack
  // (lane 0) follow them on the device.
  comm::staged_allreduce(a.input, a.output, mover, *staging_, active_.staging_chunk_bytes, [&](const Buffer& chunk) {
    AllreduceArgs h = a;
    h.input = h.output = chunk;
    host_allreduce(h);
  }, false);
}

void Executor::host_allreduce(const AllreduceArgs& a) {
  const Buffer& out = a.output;
  if (out.data != a.input.data && a.input.count) std::memcpy(out.data, a.input.data, a.input.bytes());
  if (out.count == 0 || topo_.size == 1) return;

  // Check what the topology allows before any data moves (same verdict on every rank).
  const AllreduceAlgorithm& entry = checked_algorithm(resolve(a.algorithm, out.bytes(), active_));

  const AverageRule avg = AverageRule::of(a.average, out.dtype, topo_.size);
  if (avg.before != 1.0) kernels::scale_cpu(out.data, out.count, out.dtype, avg.before);

  timeline::Phase phase(timeline::on() ? entry.phase : nullptr);
  entry.host(out, a.op, allreduce_run(nullptr));
  if (avg.after != 1.0) kernels::scale_cpu(out.data, out.count, out.dtype, avg.after);
}

namespace {
// A fused batch as the pack and unpack kernels take it: sources, destinations and element counts
// in batch order, and their total.
struct BatchLayout {
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  std::vector<size_t> counts;
  size_t total = 0;
  explicit BatchLayout(const std::vector<const AllreduceArgs*>& batch) {
    for (const AllreduceArgs* a : batch) {
      srcs.push_back(a->input.data);
      dsts.push_back(a->output.data);
      counts.push_back(a->input.count);
      total += a->input.count;
    }
  }
};
}  // namespace

void Executor::fused_allreduce(const std::vector<const AllreduceArgs*>& batch) {
  const AllreduceArgs& head = *batch.front();
  if (device_fusion(head)) return device_fused_allreduce(batch);
  const DType dtype = head.input.dtype;
  const BatchLayout layout(batch);
  const auto& [srcs, dsts, counts, total] = layout;
  const size_t bytes = total * kernels::dtype_size(dtype);
  const Algorithm algo = resolve(head.algorithm, bytes, active_);
  // Refused shapes fall through to allreduce, which names the reason.
  const WindowFusion window = allreduce_refusal(algo, job_shape()).empty() ? allreduce_algorithm(algo).fusion
                                                                            : WindowFusion::NONE;
  if (topo_.size > 1 && topo_.local_size > 1 && window != WindowFusion::NONE) {
    FusedTensors t;
    t.srcs = srcs;
    t.dsts = dsts;
    t.counts = counts;
    t.dtype = dtype;
    t.world_size = topo_.size;
    const AverageRule avg = AverageRule::of(head.average, dtype, topo_.size);
    timeline::Phase phase("SHM_FUSED_ALLREDUCE");
    windowed_fused_allreduce(t, head.op, avg.before != 1.0, avg.after, shm(),
                             window == WindowFusion::CROSS ? topo_.cross : MPI_COMM_NULL,
                             active_.ring_chunk_bytes, active_.shm_chunk_bytes);
    return;
  }
  if (fusion_buffer_.size() < bytes) fusion_buffer_.resize(bytes);
  timeline::Phase phase("PACK");
  // One pack in batch order (the same on every rank), one allreduce, one
  // unpack with the average's 1/N fused in (fp16/bf16 are pre-divided instead).
  kernels::fusion_pack_cpu(srcs.data(), counts.data(), counts.size(), fusion_buffer_.data(), dtype);
  double unpack_scale = 1.0;
  AllreduceArgs fused = fused_args(head, fusion_buffer_.data(), total, &unpack_scale);
  phase.next(nullptr);
  allreduce(fused);
  phase.next("UNPACK");
  kernels::fusion_unpack_cpu(fusion_buffer_.data(), dsts.data(), counts.data(), counts.size(), dtype, unpack_scale);
}

AllreduceArgs Executor::fused_args(const AllreduceArgs& head, void* flat, size_t total, double* unpack_scale) const {
  AllreduceArgs fused = head;
  fused.input.data = fused.output.data = flat;
  fused.input.count = fused.output.count = total;
  // A division after the sum moves into the unpack; a division before it stays with the allreduce.
  *unpack_scale = AverageRule::of(head.average, head.input.dtype, topo_.size).after;
  if (*unpack_scale != 1.0) fused.average = false;
  return fused;
}

bool Executor::device_fusion(const AllreduceArgs& head) const {
  return path_of(head.input.device) != MemoryPath::HOST;
}

void Executor::device_fused_allreduce(const std::vector<const AllreduceArgs*>& batch) {
  const AllreduceArgs& head = *batch.front();
  const DType dtype = head.input.dtype;
  const BatchLayout layout(batch);
  const auto& [srcs, dsts, counts, total] = layout;
  MemoryMover& mover = mover_for(head.input);
  MemoryMover::Lease flat = mover.fusion_memory(total * kernels::dtype_size(dtype));
  timeline::Phase phase("DEVICE_PACK");
  mover.pack(srcs.data(), counts.data(), counts.size(), flat.get(), dtype);
  double unpack_scale = 1.0;
  AllreduceArgs fused = fused_args(head, flat.get(), total, &unpack_scale);
  phase.next(nullptr);
  allreduce(fused);
  phase.next("DEVICE_UNPACK");
  mover.unpack(flat.get(), dsts.data(), counts.data(), counts.size(), dtype, unpack_scale);
}

MemoryMover& Executor::mover_of_device(int device) {
  Buffer b;
  b.device = device < 0 ? Device::CPU : Device::CUDA;
  b.device_index = device;
  return mover_for(b);
}

ShmWindow& Executor::shm() {
  if (!shm_) shm_ = std::make_unique<ShmWindow>(topo_.local);
  shm_->set_growth_limit(active_.fusion_threshold_bytes);  // the same on every rank (agreed options)
  return *shm_;
}

void Executor::memory_stats(EngineStats* s) {
  if (shm_) s->shm_allocations = shm_->allocations(), s->shm_segment_bytes = shm_->capacity();
  s->fusion_buffer_bytes = fusion_buffer_.size();
  if (peer_) s->peer_block_bytes = peer_->block_bytes(), s->peer_allocations = peer_->allocations();
  s->peer_allreduces = peer_allreduces_;
  s->staging_bytes = 2 * staging_->bytes;
  s->device_cache_bytes = s->device_cache_allocations = 0;
  s->device_fusion_bytes = s->device_fusion_allocations = 0;
  s->compressed_cache_bytes = s->compressed_cache_allocations = 0;
  auto count_mover = [s](const MemoryMover* m) {
    if (!m) return;
    s->device_cache_bytes += m->cached_bytes();
    s->device_cache_allocations += m->allocations();
    s->device_fusion_bytes += m->fusion_bytes();
    s->device_fusion_allocations += m->fusion_allocations();
    s->compressed_cache_bytes += m->compressed_bytes();
    s->compressed_cache_allocations += m->compressed_allocations();
  };
  {
    std::lock_guard<std::mutex> movers(movers_mu_);
    count_mover(host_mover_.get());
    for (const auto& m : cuda_movers_) count_mover(m.get());
  }
}

}  // namespace comm
}  // namespace pycomm
