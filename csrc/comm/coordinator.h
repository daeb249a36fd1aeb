// Agreement between ranks before every operation, and the stall watchdog.
//
// Named operations under EngineOptions::pair_by_name (Horovod's rule) pair by
// name in any order: a rank whose queue head is a named operation that some
// rank has not submitted sets it aside ("parks" it) and goes on with the
// operations behind it; a parked operation runs, alone, in the first round in
// which every rank has it (at its head or parked). Proposals carry the parked
// signatures after the head batch (flag kParked). Every other operation pairs
// by submission order.
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
//
// Leaving: shutdown() is a round of its own (Collective::SHUTDOWN). When a
// rank proposes it while others propose operations, every rank gets a
// CommError naming the rank that left and the operations it did not join;
// from then on the coordinator does not wait for that rank, and any later
// operation fails at once with the same explanation. A coordinator (rank 0)
// that leaves tells the others so; they fail at once afterwards too.
//
// Stalls: after `warning_s` the coordinator asks the missing ranks what they
// are doing (an idle engine answers between operations) and reports, per
// rank, whether it is alive outside pycomm, inside which operation it is, or
// silent; after `abort_s` it aborts the job.
#pragma once
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {

enum class Collective : int32_t {
  ALLREDUCE = 1, BROADCAST = 2, ALLGATHER = 3, BARRIER = 4,
  SHUTDOWN = 5,  // the rank leaves (pycomm.shutdown(), or the end of its program)
  OPTIONS = 6,   // set_options: applied at the same point of every rank's queue
  CUSTOM = 7,    // an engine operation defined elsewhere (compressed allreduce)
  REDUCE_SCATTER = 8, ALLTOALL = 9, REDUCE = 10, GATHER = 11, SCATTER = 12,
  JOIN = 13,     // pycomm.join(): the rank answers the others' operations until every rank has joined
  BACKUP = 14,   // a backup-worker session (backup_allreduce.h): root = B, extra = its first step
};

struct Signature {
  static constexpr int kMaxDims = 6;
  static constexpr int kNameLen = 48;
  // EngineOptions::pair_by_name: this named operation pairs across ranks by name, in any order.
  static constexpr int32_t kByName = 1;
  // In a proposal: an operation a rank has set aside until every rank submits its name (not its queue's head).
  static constexpr int32_t kParked = 2;
  int32_t kind = 0;
  int32_t dtype = -1;
  int32_t op = -1;         // ReduceOp, or -1
  int32_t algorithm = -1;  // Algorithm, or -1
  int32_t root = -1;
  int32_t ndim = 0;
  int32_t extra = 0;       // allreduce: 1 for op=avg
  int32_t device = 0;      // Device: one rank passing CPU memory and another CUDA memory is an error
  int32_t flags = 0;       // kByName, kParked
  int32_t reserved = 0;    // keeps the struct free of padding (signatures are compared with memcmp)
  int64_t numel = 0;       // -1: not compared (allgather's first dimension may differ)
  int64_t dims[kMaxDims] = {0};
  char name[kNameLen] = {0};

  // kind, dtype, device, element count, shape and name of `b`; op, algorithm and root unset.
  static Signature of(Collective kind, const Buffer& b, const std::vector<int64_t>& shape, const std::string& name);
  void set_name(const std::string& n);
  // What check_consistency=False still compares: what the data movement
  // needs to stay in bounds (kind, dtype, element count, row shape of an
  // allgather, root, algorithm) -- not names or reduction ops.
  Signature cheap() const;
  std::string describe() const;  // e.g. "allreduce 'fc.weight' float16[1000, 3] op=sum algorithm=ring"
};

// What a join round told this rank (Coordinator::coordinate_join).
struct JoinInfo {
  int joined = 0;       // ranks that have joined (pycomm.join()) and contribute nothing this round
  bool done = false;    // this rank proposed JOIN and every rank has joined
  int last_rank = -1;   // when done: the rank that joined last
  std::vector<Signature> ops;  // this rank proposed JOIN: the operations it answers now (the others' batch)
};

// What a round decided besides "run the first `count` operations of the head batch".
struct Resolution {
  enum Kind { HEAD, NAMED, PARK, RETRY } kind = HEAD;
  // NAMED: run the operation named `name` alone (the head, or a parked one).
  // PARK: set the head aside. RETRY: nothing runs; propose again.
  std::string name;
};

struct StallOptions {
  double warning_s = 60.0;  // report missing ranks after this long (0: never)
  double abort_s = 600.0;   // MPI_Abort the job after this long (0: never)
};

// Writes `line` to stderr, then ends the job with MPI_Abort (exit code 3) after a short pause: the
// launcher forwards a rank's output asynchronously, and MPICH's, torn down by the abort, once lost
// the line written just before it. Every stall abort goes through here.
[[noreturn]] void abort_job(const std::string& line);

// What a rank's engine is doing, for the coordinator's stall reports.
using StatusFn = std::function<std::string()>;

class Coordinator {
 public:
  // `control` is a communicator used for nothing else.
  explicit Coordinator(MPI_Comm control);

  // One round. Returns how many of `proposal` (>= 1) run now; throws CommError
  // (the same message on every rank) if the ranks disagree. `full`: compare
  // the whole signatures, else only Signature::cheap().
  size_t agree(const std::vector<Signature>& proposal, const char* what, const StallOptions& stall,
               bool full = true);

  uint64_t rounds() const { return round_; }
  // The control communicator (a backup session's messages travel on it, backup_allreduce.cpp).
  MPI_Comm control() const { return comm_; }
  // After agree(): how many ranks have joined, and for a rank that proposed
  // JOIN what it answers now (or that every rank has joined).
  const JoinInfo& join_info() const { return join_; }
  // After agree(), also when it threw: which operation the round was about (pair_by_name).
  const Resolution& resolution() const { return resolution_; }

  // Called by an idle engine between operations: answer the coordinator's
  // stall query, if one came, with `status()`. Cheap (one MPI_Iprobe).
  void answer_queries(const StatusFn& status);

 private:
  size_t coordinate(const std::vector<Signature>& mine, const char* what, const StallOptions& stall, bool full);
  size_t follow(const std::vector<Signature>& mine, const StallOptions& stall);
  // Ask `ranks` what they are doing; wait up to `wait_s` for the answers.
  std::vector<std::string> ask(const std::vector<int>& ranks, double wait_s);
  // Rank 0, a round in which some ranks propose JOIN (coordinator_join.cpp).
  size_t coordinate_join(const std::vector<std::vector<Signature>>& all, const char* what, bool full);
  // Rank 0: send every other rank the decision (plus `text`, or to the joined ranks `ops`).
  void send_join_decisions(int32_t status, int32_t count, int32_t joined, const std::string& text,
                           const Signature* ops);
  // Rank 0, pair_by_name: decides the round when a parked operation or a
  // named head that not every rank shares is involved; returns false to leave it to the usual rule
  // (with the parked signatures removed from `all`).
  bool coordinate_by_name(std::vector<std::vector<Signature>>& all, const std::vector<int>& staying, const char* what,
                          const StallOptions& stall, bool full, size_t* count);
  // Rank 0: one decision per rank (statuses[r]), with the same text for all.
  void send_decisions(const std::vector<int32_t>& statuses, int32_t count, const std::string& text);

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  uint64_t round_ = 0;
  std::vector<bool> left_;        // rank 0: ranks that have left the job
  std::string coordinator_left_;  // other ranks: why rank 0 is gone (empty while it is here)
  std::vector<bool> joined_;      // rank 0: ranks inside pycomm.join()
  int last_joined_ = -1;          // rank 0: the rank that joined last
  JoinInfo join_;
  Resolution resolution_;
  // Rank 0, pair_by_name: since when rounds have only parked or retried (nothing ran), for stall reports.
  std::chrono::steady_clock::time_point stuck_since_{};
  bool stuck_warned_ = false;
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
