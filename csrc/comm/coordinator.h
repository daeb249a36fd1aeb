// Agreement between ranks before every operation, and the stall watchdog.
//
// Each round, every rank sends rank 0 (the coordinator) its proposal: the
// signatures (kind, dtype, shape, op, algorithm, root, name) of the
// operations at the head of its queue that could run now -- one, or several
// allreduces that may be fused. Rank 0 checks that all ranks propose the same
// operations in the same order, decides how many of them run (the longest
// prefix every rank has ready, so fused batches are identical everywhere) and
// answers everyone. Ranks that disagree all get the same error naming the
// disagreement; ranks that wait too long for others are told which ranks and
// which tensors are missing. Two point-to-point messages per rank per round,
// on a communicator of their own.
#pragma once
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {

enum class Collective : int32_t { ALLREDUCE = 1, BROADCAST = 2, ALLGATHER = 3, BARRIER = 4,
                                  REDUCE_SCATTER = 5, ALLTOALL = 6, REDUCE = 7, GATHER = 8, SCATTER = 9 };

struct Signature {
  static constexpr int kMaxDims = 6;
  static constexpr int kNameLen = 48;
  int32_t kind = 0;
  int32_t dtype = -1;
  int32_t op = -1;         // ReduceOp, or -1
  int32_t algorithm = -1;  // Algorithm, or -1
  int32_t root = -1;
  int32_t ndim = 0;
  int32_t extra = 0;       // allreduce: 1 for op=avg
  int32_t pad = 0;
  int64_t numel = 0;       // -1: not compared (allgather's first dimension may differ)
  int64_t dims[kMaxDims] = {0};
  char name[kNameLen] = {0};

  void set_name(const std::string& n);
  std::string describe() const;  // e.g. "allreduce 'fc.weight' float16[1000, 3] op=sum algorithm=ring"
};

struct StallOptions {
  double warning_s = 60.0;  // report missing ranks after this long (0: never)
  double abort_s = 0.0;     // MPI_Abort the job after this long (0: never)
};

class Coordinator {
 public:
  // `control` is a communicator used for nothing else.
  explicit Coordinator(MPI_Comm control);

  // One round. Returns how many of `proposal` (>= 1) run now; throws CommError
  // (the same message on every rank) if the ranks disagree.
  size_t agree(const std::vector<Signature>& proposal, const char* what, const StallOptions& stall);

  uint64_t rounds() const { return round_; }

 private:
  size_t coordinate(const std::vector<Signature>& mine, const char* what, const StallOptions& stall);
  size_t follow(const std::vector<Signature>& mine, const StallOptions& stall);

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  uint64_t round_ = 0;
};

// Wait politely: spin briefly, then yield, then sleep in short steps, so a
// waiting rank does not starve the ones it is waiting for on a busy machine.
class Backoff {
 public:
  void pause();
  double elapsed_s() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  uint64_t polls_ = 0;
};

}  // namespace comm
}  // namespace pycomm
