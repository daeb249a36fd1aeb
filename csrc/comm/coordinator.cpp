#include "coordinator.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>
#include <thread>

#include "engine.h"

namespace pycomm {
namespace comm {
namespace {

constexpr int kTagPropose = 101;
constexpr int kTagDecide = 102;
constexpr int kTagText = 103;
constexpr int kTagStall = 104;

struct Decision {
  int64_t round;
  int32_t status;  // 0: run `count` operations; 1: error, text follows
  int32_t count;
  int32_t text_len;
  int32_t pad;
};

const char* kind_name(int32_t kind) {
  switch (static_cast<Collective>(kind)) {
    case Collective::ALLREDUCE: return "allreduce";
    case Collective::BROADCAST: return "broadcast";
    case Collective::ALLGATHER: return "allgather";
    case Collective::BARRIER: return "barrier";
    case Collective::REDUCE_SCATTER: return "reduce_scatter";
    case Collective::ALLTOALL: return "alltoall";
    case Collective::REDUCE: return "reduce";
    case Collective::GATHER: return "gather";
    case Collective::SCATTER: return "scatter";
  }
  return "unknown";
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? "," : "") << ranks[i];
  return s.str();
}

void log_line(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace

void Signature::set_name(const std::string& n) {
  std::memset(name, 0, sizeof name);
  std::memcpy(name, n.data(), std::min(n.size(), sizeof name - 1));
}

std::string Signature::describe() const {
  std::ostringstream s;
  s << kind_name(kind);
  if (static_cast<Collective>(kind) == Collective::BARRIER) return s.str();
  if (name[0]) s << " '" << name << "'";
  s << " " << kernels::dtype_name(static_cast<DType>(dtype)) << "[";
  int shown = std::min(ndim, kMaxDims);
  for (int i = 0; i < shown; ++i) {
    if (i) s << ", ";
    if (i == 0 && numel < 0) s << "*";  // allgather: first dimension may differ
    else s << dims[i];
  }
  if (ndim > kMaxDims) s << ", ...";
  s << "]";
  if (ndim > kMaxDims) s << " (" << numel << " elements)";
  if (op >= 0) s << " op=" << (extra == 1 ? "avg" : kernels::reduce_op_name(static_cast<ReduceOp>(op)));
  if (algorithm >= 0) s << " algorithm=" << algorithm_name(static_cast<Algorithm>(algorithm));
  if (root >= 0) s << " root=" << root;
  return s.str();
}

void Backoff::pause() {
  ++polls_;
  if (polls_ < 64) return;  // spin: the answer usually comes within microseconds
  if (polls_ < 1024) {
    sched_yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(polls_ < 20000 ? 20 : 500));
}

Coordinator::Coordinator(MPI_Comm control) : comm_(control) {
  PYCOMM_MPI_CHECK(MPI_Comm_rank(control, &rank_));
  PYCOMM_MPI_CHECK(MPI_Comm_size(control, &size_));
}

size_t Coordinator::agree(const std::vector<Signature>& proposal, const char* what, const StallOptions& stall) {
  if (proposal.empty()) throw CommError("pycomm internal error: empty proposal");
  ++round_;
  if (size_ == 1) return proposal.size();
  return rank_ == 0 ? coordinate(proposal, what, stall) : follow(proposal, stall);
}

size_t Coordinator::coordinate(const std::vector<Signature>& mine, const char* what, const StallOptions& stall) {
  std::vector<std::vector<Signature>> all(static_cast<size_t>(size_));
  std::vector<bool> arrived(static_cast<size_t>(size_), false);
  all[0] = mine;
  arrived[0] = true;
  int missing = size_ - 1;
  Backoff wait;
  bool warned = false;
  while (missing > 0) {
    bool progress = false;
    for (int r = 1; r < size_; ++r) {
      if (arrived[r]) continue;
      int flag = 0;
      MPI_Status st;
      PYCOMM_MPI_CHECK(MPI_Iprobe(r, kTagPropose, comm_, &flag, &st));
      if (!flag) continue;
      int bytes = 0;
      PYCOMM_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &bytes));
      all[r].resize(static_cast<size_t>(bytes) / sizeof(Signature));
      PYCOMM_MPI_CHECK(MPI_Recv(all[r].data(), bytes, MPI_BYTE, r, kTagPropose, comm_, MPI_STATUS_IGNORE));
      arrived[r] = true;
      --missing;
      progress = true;
    }
    if (progress || missing == 0) continue;
    double waited = wait.elapsed_s();
    bool warn = stall.warning_s > 0 && waited >= stall.warning_s && !warned;
    bool abort_now = stall.abort_s > 0 && waited >= stall.abort_s;
    if (warn || abort_now) {
      std::vector<int> absent, present;
      for (int r = 0; r < size_; ++r) (arrived[r] ? present : absent).push_back(r);
      std::ostringstream msg;
      msg << "pycomm stall: " << what << " #" << round_ << " (" << mine.front().describe()
          << (mine.size() > 1 ? " and " + std::to_string(mine.size() - 1) + " more" : "") << "): "
          << rank_list(absent) << (absent.size() == 1 ? " has" : " have") << " not submitted it after " << static_cast<int>(waited) << " s; "
          << rank_list(present) << (present.size() == 1 ? " is" : " are") << " waiting.";
      if (abort_now) msg << " Aborting the job (PYCOMM_STALL_ABORT_S=" << stall.abort_s << ").";
      std::string text = msg.str();
      log_line(text);
      warned = true;
      if (abort_now) MPI_Abort(MPI_COMM_WORLD, 3);
      // Tell the waiting ranks too, so every log names the culprits.
      for (int r : present) {
        if (r == 0) continue;
        PYCOMM_MPI_CHECK(MPI_Send(text.data(), static_cast<int>(text.size()), MPI_CHAR, r, kTagStall, comm_));
      }
    }
    wait.pause();
  }

  // The operations run now: the longest prefix that every rank has ready.
  size_t count = mine.size();
  for (const auto& p : all) count = std::min(count, p.size());
  // Ranks must agree on every operation of the prefix. A disagreement past
  // the first operation shortens the prefix; it is reported in the round in
  // which that operation comes first.
  std::string error;
  for (size_t i = 0; i < count; ++i) {
    bool agree = true;
    for (int r = 1; r < size_ && agree; ++r) agree = std::memcmp(&all[r][i], &all[0][i], sizeof(Signature)) == 0;
    if (agree) continue;
    if (i > 0) {
      count = i;
      break;
    }
    std::map<std::string, std::vector<int>> groups;
    std::vector<std::string> order;
    for (int r = 0; r < size_; ++r) {
      std::string d = all[r][i].describe();
      if (!groups.count(d)) order.push_back(d);
      groups[d].push_back(r);
    }
    std::ostringstream msg;
    msg << what << ": ranks disagree on the call: ";
    for (size_t g = 0; g < order.size(); ++g) msg << (g ? "; " : "") << rank_list(groups[order[g]]) << " passed " << order[g];
    msg << ". Every rank must make the same collective calls in the same order.";
    error = msg.str();
    break;
  }

  Decision d{static_cast<int64_t>(round_), error.empty() ? 0 : 1, static_cast<int32_t>(error.empty() ? count : 1),
             static_cast<int32_t>(error.size()), 0};
  std::vector<MPI_Request> reqs;
  reqs.reserve(static_cast<size_t>(2 * size_));
  for (int r = 1; r < size_; ++r) {
    reqs.emplace_back();
    PYCOMM_MPI_CHECK(MPI_Isend(&d, sizeof d, MPI_BYTE, r, kTagDecide, comm_, &reqs.back()));
    if (!error.empty()) {
      reqs.emplace_back();
      PYCOMM_MPI_CHECK(MPI_Isend(error.data(), static_cast<int>(error.size()), MPI_CHAR, r, kTagText, comm_,
                                 &reqs.back()));
    }
  }
  PYCOMM_MPI_CHECK(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
  if (!error.empty()) throw CommError(error);
  return count;
}

size_t Coordinator::follow(const std::vector<Signature>& mine, const StallOptions& stall) {
  MPI_Request send;
  PYCOMM_MPI_CHECK(MPI_Isend(mine.data(), static_cast<int>(mine.size() * sizeof(Signature)), MPI_BYTE, 0, kTagPropose,
                             comm_, &send));
  Decision d{};
  MPI_Request recv;
  PYCOMM_MPI_CHECK(MPI_Irecv(&d, sizeof d, MPI_BYTE, 0, kTagDecide, comm_, &recv));
  Backoff wait;
  bool heard = false, warned = false;
  for (;;) {
    int done = 0;
    PYCOMM_MPI_CHECK(MPI_Test(&recv, &done, MPI_STATUS_IGNORE));
    if (done) break;
    int flag = 0;
    MPI_Status st;
    PYCOMM_MPI_CHECK(MPI_Iprobe(0, kTagStall, comm_, &flag, &st));
    if (flag) {  // the coordinator's stall report: repeat it in this rank's log
      int len = 0;
      PYCOMM_MPI_CHECK(MPI_Get_count(&st, MPI_CHAR, &len));
      std::string text(static_cast<size_t>(len), '\0');
      PYCOMM_MPI_CHECK(MPI_Recv(&text[0], len, MPI_CHAR, 0, kTagStall, comm_, MPI_STATUS_IGNORE));
      log_line(text + " (seen from rank " + std::to_string(rank_) + ")");
      heard = true;
      continue;
    }
    double waited = wait.elapsed_s();
    if (!heard && !warned && stall.warning_s > 0 && waited >= stall.warning_s + 1.0) {
      log_line("pycomm stall: rank " + std::to_string(rank_) + " has waited " + std::to_string(static_cast<int>(waited)) +
               " s at " + mine.front().describe() + "; rank 0, which coordinates, has not submitted it yet.");
      warned = true;
    }
    if (stall.abort_s > 0 && waited >= stall.abort_s + 2.0) {
      log_line("pycomm stall: rank " + std::to_string(rank_) + " aborting the job after " +
               std::to_string(static_cast<int>(waited)) + " s at " + mine.front().describe() + ".");
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
    wait.pause();
  }
  PYCOMM_MPI_CHECK(MPI_Wait(&send, MPI_STATUS_IGNORE));
  if (d.round != static_cast<int64_t>(round_))
    throw CommError("pycomm internal error: coordination rounds out of step (" + std::to_string(d.round) + " vs " +
                    std::to_string(round_) + ")");
  if (d.status != 0) {
    std::string text(static_cast<size_t>(d.text_len), '\0');
    PYCOMM_MPI_CHECK(MPI_Recv(&text[0], d.text_len, MPI_CHAR, 0, kTagText, comm_, MPI_STATUS_IGNORE));
    throw CommError(text);
  }
  return static_cast<size_t>(d.count);
}

}  // namespace comm
}  // namespace pycomm
