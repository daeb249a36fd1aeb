// The allreduce table (allreduce_catalogue.h) and the rules that read it.
#include "allreduce_catalogue.h"

#include "algorithms.h"
#include "memory_mover.h"

namespace pycomm {
namespace comm {

namespace {

void ring_host(const Buffer& b, ReduceOp op, const AllreduceRun& r) {
  ring_allreduce(b, op, r.topo.world, r.ring_chunk_bytes);
}
void ring_device(const Buffer& b, ReduceOp op, const AllreduceRun& r) {
  ring_allreduce(b, op, r.topo.world, r.ring_chunk_bytes, r.device);
}

void mpi_host(const Buffer& b, ReduceOp op, const AllreduceRun& r) { mpi_allreduce(b, op, r.topo.world); }
void mpi_device(const Buffer& b, ReduceOp op, const AllreduceRun& r) {
  // MPI has no fp16/bf16 op on device memory, and pycomm's NaN-propagating float min/max
  // are its own: those reductions take the ring, whose reductions run on the device.
  const bool half = b.dtype == DType::F16 || b.dtype == DType::BF16;
  const bool own_op = half || ((op == ReduceOp::MIN || op == ReduceOp::MAX) &&
                               (b.dtype == DType::F32 || b.dtype == DType::F64));
  if (!own_op || (b.device == Device::CPU && !half)) return mpi_allreduce(b, op, r.topo.world);
  ring_device(b, op, r);
}

void shm_host(const Buffer& b, ReduceOp op, const AllreduceRun& r) {
  shm_allreduce(b, op, r.shm(), r.shm_chunk_bytes);
}

void hierarchical_host(const Buffer& b, ReduceOp op, const AllreduceRun& r) {
  hierarchical_allreduce(b, op, r.shm(), r.topo.cross, true, r.ring_chunk_bytes);
}
void hierarchical_device(const Buffer& b, ReduceOp op, const AllreduceRun& r) {
  device_hierarchical_allreduce(b, op, r.topo.local, r.topo.cross, r.ring_chunk_bytes, *r.device);
}

void hierarchical_master_host(const Buffer& b, ReduceOp op, const AllreduceRun& r) {
  hierarchical_master_allreduce(b, op, r.shm(), r.topo.local_rank == 0 ? r.topo.cross : MPI_COMM_NULL, true,
                                r.ring_chunk_bytes);
}

}  // namespace

const std::vector<AllreduceAlgorithm>& allreduce_algorithms() {
  //            id                              name                   phase
  //            summary
  //            one_node equal_nodes across_nodes fusion  host  device
  static const std::vector<AllreduceAlgorithm> table = {
      {Algorithm::RING, "ring", "RING_ALLREDUCE",
       "reduce-scatter then allgather around one ring of all ranks, pipelined in chunks",
       false, false, false, WindowFusion::NONE, ring_host, ring_device},
      {Algorithm::MPI, "mpi", "MPI_ALLREDUCE",
       "the MPI library's own MPI_Allreduce",
       false, false, false, WindowFusion::NONE, mpi_host, mpi_device},
      {Algorithm::SHM, "shm", "SHM_ALLREDUCE",
       "one node: copy into a shared-memory window, each rank reduces its slice, copy out",
       true, false, false, WindowFusion::LOCAL, shm_host, nullptr},
      {Algorithm::HIERARCHICAL, "hierarchical", "HIERARCHICAL_ALLREDUCE",
       "reduce-scatter in the node's window, one ring per local rank across nodes, allgather in the node",
       false, true, true, WindowFusion::CROSS, hierarchical_host, hierarchical_device},
      {Algorithm::HIERARCHICAL_MASTER, "hierarchical_master", "HIERARCHICAL_MASTER_ALLREDUCE",
       "reduce to each node's first rank, ring among those, broadcast in the node",
       false, true, true, WindowFusion::NONE, hierarchical_master_host, nullptr},
  };
  return table;
}

const AllreduceAlgorithm& allreduce_algorithm(Algorithm a) {
  for (const auto& e : allreduce_algorithms())
    if (e.id == a) return e;
  throw CommError("allreduce: no algorithm with wire value " + std::to_string(static_cast<int>(a)) +
                  " (\"auto\" is resolved before this point)");
}

const char* algorithm_name(Algorithm a) {
  if (a == Algorithm::AUTO) return "auto";
  for (const auto& e : allreduce_algorithms())
    if (e.id == a) return e.name;
  return "unknown";
}

Algorithm parse_algorithm(const std::string& name) {
  if (name == "auto") return Algorithm::AUTO;
  std::string choices = "auto";
  for (const auto& e : allreduce_algorithms()) {
    if (name == e.name) return e.id;
    choices += std::string(", ") + e.name;
  }
  throw CommError("unknown allreduce algorithm '" + name + "'; choose " + choices);
}

std::string allreduce_refusal(Algorithm a, const JobShape& s) {
  const AllreduceAlgorithm& e = allreduce_algorithm(a);
  if (e.one_node && s.num_nodes > 1)
    return std::string("allreduce algorithm '") + e.name + "' reduces within one node, but this job spans " +
           std::to_string(s.num_nodes) + " nodes; use 'hierarchical' or 'ring'";
  if (e.equal_nodes && !s.homogeneous)
    return std::string("allreduce algorithm '") + e.name +
           "' needs the same number of ranks on every node; this job's nodes differ in size "
           "(use 'ring' or 'mpi', or set PYCOMM_RANKS_PER_NODE to a divisor of the job size)";
  return "";
}

std::vector<Algorithm> allreduce_offered(const JobShape& s) {
  std::vector<Algorithm> out;
  for (const auto& e : allreduce_algorithms()) {
    if (!allreduce_refusal(e.id, s).empty()) continue;
    if (e.across_nodes && s.num_nodes == 1) continue;
    if (e.one_node && s.size == 1) continue;
    out.push_back(e.id);
  }
  return out;
}

Algorithm choose_auto(size_t bytes, const JobShape& s, size_t auto_ring_min_bytes, const AutoTable& table) {
  for (const auto& entry : table)
    if (bytes <= entry.first) return entry.second;
  // One node: shm at every size (bench/auto_regret.py: at 4-16 KiB its three
  // fences beat MPI_Allreduce by 5-28% at 2 and 4 ranks, and it wins above).
  if (s.num_nodes == 1 && s.size > 1) return Algorithm::SHM;
  if (bytes < auto_ring_min_bytes) return Algorithm::MPI;
  if (s.num_nodes > 1 && s.homogeneous && s.local_size > 1) return Algorithm::HIERARCHICAL;
  return Algorithm::RING;
}

Algorithm device_substitute(Algorithm chosen, size_t bytes, size_t auto_ring_min_bytes) {
  const AllreduceAlgorithm& e = allreduce_algorithm(chosen);
  if (e.device) return chosen;
  // A node-level form keeps its shape point-to-point; shm becomes what "auto" picks off one node.
  if (e.equal_nodes) return Algorithm::HIERARCHICAL;
  return bytes < auto_ring_min_bytes ? Algorithm::MPI : Algorithm::RING;
}

}  // namespace comm
}  // namespace pycomm
