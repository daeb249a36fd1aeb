// The allreduce algorithms, in one table: what each is called, what job shapes
// it can run on, whether it runs on device pointers, how a fused batch uses it,
// and the function that runs it. Every layer that names, checks, chooses or
// runs an allreduce algorithm reads this table: the engine's host, fused and
// device paths, the bindings, and through _C the Python validators,
// pycomm-tune and the cost model.
//
// Adding an algorithm: its function in its own file (ring_allreduce.cpp is the
// model), one entry in allreduce_catalogue.cpp, and its formula in
// pycomm/cost_model.py (tests/unit/test_allreduce_catalogue.py checks that
// every entry has one).
#pragma once
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {

class ShmWindow;
class MemoryMover;

// The wire value of each algorithm (signatures carry it): append, never renumber.
enum class Algorithm : int32_t { AUTO = 0, RING = 1, MPI = 2, SHM = 3, HIERARCHICAL = 4, HIERARCHICAL_MASTER = 5 };

// The shape of a job as the algorithms see it.
struct JobShape {
  int size = 1;
  int num_nodes = 1;
  int local_size = 1;
  bool homogeneous = true;  // the same number of ranks on every node
};

// What an algorithm may use for one call; the engine builds it.
struct AllreduceRun {
  const Topology& topo;
  size_t ring_chunk_bytes;
  size_t shm_chunk_bytes;
  std::function<ShmWindow&()> shm;  // the node's window, created on first use
  MemoryMover* device = nullptr;    // the buffer's memory on the device-direct path; null on the host
};

// How a fused batch of small tensors uses the algorithm (executor.cpp, Executor::fused_allreduce).
enum class WindowFusion {
  NONE,   // pack into the fusion buffer, run the algorithm on it, unpack
  LOCAL,  // reduce straight from the tensors in the node's window (no pack or unpack pass)
  CROSS,  // the same, with the node's shards reduced across nodes over the cross communicator
};

using AllreduceFn = void (*)(const Buffer& buf, ReduceOp op, const AllreduceRun& run);

struct AllreduceAlgorithm {
  Algorithm id;
  const char* name;     // what users pass as algorithm=
  const char* phase;    // the timeline's name for its range
  const char* summary;  // one line: the schedule
  bool one_node;        // every rank in one shared-memory window
  bool equal_nodes;     // the same number of ranks on every node
  bool across_nodes;    // offered to the tuner and cost model only when the job spans nodes
  WindowFusion fusion;
  AllreduceFn host;     // in place on host memory
  AllreduceFn device;   // in place on device memory under a CUDA-aware MPI; null: needs host memory
};

// Every algorithm, "auto" excluded, in wire order.
const std::vector<AllreduceAlgorithm>& allreduce_algorithms();
// The entry of `a`; CommError for AUTO or an unknown value.
const AllreduceAlgorithm& allreduce_algorithm(Algorithm a);
// "auto" or the entry's name.
const char* algorithm_name(Algorithm a);
// The algorithm called `name` ("auto" included); CommError naming the choices otherwise.
Algorithm parse_algorithm(const std::string& name);
// Why `a` cannot run on a job of this shape, or "" when it can (the same verdict on every rank).
std::string allreduce_refusal(Algorithm a, const JobShape& shape);
// The algorithms worth timing or modelling on this shape: those that can run, less the
// cross-node forms on one node and shm on one rank.
std::vector<Algorithm> allreduce_offered(const JobShape& shape);

// "auto" on host memory: the measured table when there is one (messages up to .first bytes
// use .second), else the built-in rule.
using AutoTable = std::vector<std::pair<size_t, Algorithm>>;
Algorithm choose_auto(size_t bytes, const JobShape& shape, size_t auto_ring_min_bytes, const AutoTable& table);
// "auto" on the device-direct path, where there is no host window: an algorithm without a
// device form is replaced by the nearest one with it.
Algorithm device_substitute(Algorithm chosen, size_t bytes, size_t auto_ring_min_bytes);

}  // namespace comm
}  // namespace pycomm
