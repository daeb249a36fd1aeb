#include "coordinator.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <thread>

#include "engine.h"
#include "fault.h"

namespace pycomm {
namespace comm {
namespace {

constexpr int kTagPropose = 101;
constexpr int kTagDecide = 102;
constexpr int kTagText = 103;
constexpr int kTagStall = 104;
constexpr int kTagQuery = 105;   // coordinator -> missing rank: what are you doing? (int64 round)
constexpr int kTagAnswer = 106;  // missing rank -> coordinator: int64 round, then text
constexpr int kTagJoinOps = 107;  // coordinator -> joined rank: the signatures it answers this round
// 108, 109: a backup session's messages (backup_allreduce.cpp)
constexpr double kAnswerWait_s = 2.0;

// kJoinRun: a joined rank answers `count` operations (signatures follow);
// kJoinDone: every rank has joined, `count` is the rank that joined last.
// pair_by_name: kNamed runs the operation whose name is the text; kNamedError fails it (text: the
// name, a NUL, the message); kPark sets the head aside; kRetry runs nothing. kJoinSkip: a joined rank
// answers nothing this round (the others' call was refused).
enum DecisionStatus : int32_t {
  kRun = 0, kError = 1, kCoordinatorLeft = 2, kJoinRun = 3, kJoinDone = 4,
  kNamed = 5, kNamedError = 6, kPark = 7, kRetry = 8, kJoinSkip = 9,
};

struct Decision {
  int64_t round;
  int32_t status;  // kRun: run `count` operations; kError / kCoordinatorLeft: error, text follows
  int32_t count;
  int32_t text_len;
  int32_t joined;  // ranks inside pycomm.join() this round
};

const char* kind_name(int32_t kind) {
  switch (static_cast<Collective>(kind)) {
    case Collective::ALLREDUCE: return "allreduce";
    case Collective::BROADCAST: return "broadcast";
    case Collective::ALLGATHER: return "allgather";
    case Collective::BARRIER: return "barrier";
    case Collective::SHUTDOWN: return "shutdown";
    case Collective::OPTIONS: return "set_options";
    case Collective::CUSTOM: return "operation";
    case Collective::REDUCE_SCATTER: return "reduce_scatter";
    case Collective::ALLTOALL: return "alltoall";
    case Collective::REDUCE: return "reduce";
    case Collective::GATHER: return "gather";
    case Collective::SCATTER: return "scatter";
    case Collective::JOIN: return "join";
    case Collective::BACKUP: return "backup session";
  }
  return "unknown";
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? "," : "") << ranks[i];
  return s.str();
}

// Whether two ranks made the same call (the whole signature, or what Signature::cheap() keeps).
bool same_call(const Signature& x, const Signature& y, bool full) {
  Signature a = full ? x : x.cheap(), b = full ? y : y.cheap();
  a.flags &= ~Signature::kParked;  // one rank's copy may be parked, another's at its head
  b.flags &= ~Signature::kParked;
  return std::memcmp(&a, &b, sizeof(Signature)) == 0;
}

void log_line(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace

void abort_job(const std::string& line) {
  log_line(line);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::_Exit(3);  // MPI_Abort does not return; said for the compiler
}

void Signature::set_name(const std::string& n) {
  std::memset(name, 0, sizeof name);
  std::memcpy(name, n.data(), std::min(n.size(), sizeof name - 1));
}

Signature Signature::of(Collective kind, const Buffer& b, const std::vector<int64_t>& shape, const std::string& name) {
  Signature s;
  s.kind = static_cast<int32_t>(kind);
  s.dtype = static_cast<int32_t>(b.dtype);
  s.device = static_cast<int32_t>(b.device);
  s.numel = static_cast<int64_t>(b.count);
  s.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size() && i < static_cast<size_t>(kMaxDims); ++i) s.dims[i] = shape[i];
  s.set_name(name);
  return s;
}

Signature Signature::cheap() const {
  Signature c = *this;
  std::memset(c.name, 0, sizeof c.name);
  c.op = -1;
  c.extra = 0;  // shapes stay: the engine records allreduces and broadcasts flat, and an allgather's rows size it
  return c;
}

std::string Signature::describe() const {
  std::ostringstream s;
  s << kind_name(kind);
  const auto k = static_cast<Collective>(kind);
  if (k == Collective::BARRIER || k == Collective::SHUTDOWN || k == Collective::JOIN) return s.str();
  if (k == Collective::BACKUP) {
    s << " '" << name << "' float32[" << numel << "] backups=" << root << " from step " << extra;
    return s.str();
  }
  if (k == Collective::OPTIONS) return s.str() + "(" + name + ") #" + std::to_string(static_cast<uint64_t>(numel) % 100000);
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
  if (device == static_cast<int32_t>(Device::CUDA)) s << " on cuda";
  if (ndim > kMaxDims) s << " (" << numel << " elements)";
  if (op >= 0) s << " op=" << (extra == 1 ? "avg" : kernels::reduce_op_name(static_cast<ReduceOp>(op)));
  if (algorithm >= 0) s << " algorithm=" << algorithm_name(static_cast<Algorithm>(algorithm));
  if (root >= 0) s << " root=" << root;
  return s.str();
}

void Backoff::pause() {
  fault::poll();  // elastic mode: a dead rank ends the wait (fault.h)
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
  left_.assign(static_cast<size_t>(size_), false);
}

size_t Coordinator::agree(const std::vector<Signature>& proposal, const char* what, const StallOptions& stall,
                          bool full) {
  if (proposal.empty()) throw CommError("pycomm internal error: empty proposal");
  fault::check();  // elastic mode: after a rank failed, every operation fails at once (fault.h)
  ++round_;
  join_ = JoinInfo{};
  resolution_ = Resolution{};
  if (size_ == 1) {
    if (static_cast<Collective>(proposal.front().kind) == Collective::JOIN) {
      join_.done = true;
      join_.last_rank = 0;
      return 1;
    }
    return proposal.size();
  }
  if (!coordinator_left_.empty()) {
    if (static_cast<Collective>(proposal.front().kind) == Collective::SHUTDOWN) return 1;
    throw CommError(std::string(what) + ": cannot run " + proposal.front().describe() + ": " + coordinator_left_);
  }
  return rank_ == 0 ? coordinate(proposal, what, stall, full) : follow(proposal, stall);
}

void Coordinator::answer_queries(const StatusFn& status) {
  if (size_ == 1 || rank_ == 0 || !coordinator_left_.empty()) return;
  for (;;) {
    int flag = 0;
    MPI_Status st;
    PYCOMM_MPI_CHECK(MPI_Iprobe(0, kTagQuery, comm_, &flag, &st));
    if (!flag) return;
    int64_t round = 0;
    PYCOMM_MPI_CHECK(MPI_Recv(&round, 1, MPI_INT64_T, 0, kTagQuery, comm_, MPI_STATUS_IGNORE));
    std::string text = status();
    std::vector<char> msg(sizeof round + text.size());
    std::memcpy(msg.data(), &round, sizeof round);
    std::memcpy(msg.data() + sizeof round, text.data(), text.size());
    PYCOMM_MPI_CHECK(MPI_Send(msg.data(), static_cast<int>(msg.size()), MPI_BYTE, 0, kTagAnswer, comm_));
  }
}

std::vector<std::string> Coordinator::ask(const std::vector<int>& ranks, double wait_s) {
  std::vector<std::string> answers(static_cast<size_t>(size_));
  const int64_t round = static_cast<int64_t>(round_);
  std::vector<MPI_Request> reqs(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i)
    PYCOMM_MPI_CHECK(MPI_Isend(&round, 1, MPI_INT64_T, ranks[i], kTagQuery, comm_, &reqs[i]));
  size_t pending = ranks.size();
  Backoff wait;
  while (pending > 0 && wait.elapsed_s() < wait_s) {
    int flag = 0;
    MPI_Status st;
    PYCOMM_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kTagAnswer, comm_, &flag, &st));
    if (!flag) {
      wait.pause();
      continue;
    }
    int bytes = 0;
    PYCOMM_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &bytes));
    std::vector<char> msg(static_cast<size_t>(bytes));
    PYCOMM_MPI_CHECK(MPI_Recv(msg.data(), bytes, MPI_BYTE, st.MPI_SOURCE, kTagAnswer, comm_, MPI_STATUS_IGNORE));
    int64_t r = -1;
    if (msg.size() >= sizeof r) std::memcpy(&r, msg.data(), sizeof r);
    if (r != round) continue;  // an answer to an earlier round's question
    std::string& a = answers[static_cast<size_t>(st.MPI_SOURCE)];
    if (a.empty()) --pending;
    a.assign(msg.data() + sizeof r, msg.size() - sizeof r);
  }
  // A question nobody answered stays queued at that rank; it is answered (and
  // ignored here) once the rank's engine is idle again.
  for (auto& req : reqs) {
    int done = 0;
    PYCOMM_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (!done) PYCOMM_MPI_CHECK(MPI_Request_free(&req));
  }
  return answers;
}

size_t Coordinator::coordinate(const std::vector<Signature>& mine, const char* what, const StallOptions& stall,
                               bool full) {
  std::vector<std::vector<Signature>> all(static_cast<size_t>(size_));
  std::vector<bool> arrived(static_cast<size_t>(size_), false);
  all[0] = mine;
  arrived[0] = true;
  int missing = 0;
  for (int r = 1; r < size_; ++r) {
    if (left_[r]) arrived[r] = true;  // gone: nothing to wait for
    else ++missing;
  }
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
      for (int r = 0; r < size_; ++r) {
        if (left_[r]) continue;
        (arrived[r] ? present : absent).push_back(r);
      }
      // Ask the missing ranks what they are doing: an idle engine answers.
      std::vector<std::string> answers = ask(absent, kAnswerWait_s);
      std::ostringstream msg;
      msg << "pycomm stall: " << what << " #" << round_ << " (" << mine.front().describe()
          << (mine.size() > 1 ? " and " + std::to_string(mine.size() - 1) + " more" : "") << "): "
          << rank_list(absent) << (absent.size() == 1 ? " has" : " have") << " not submitted it after "
          << static_cast<int>(waited) << " s; " << rank_list(present) << (present.size() == 1 ? " is" : " are")
          << " waiting.";
      for (int r : absent) {
        const std::string& a = answers[static_cast<size_t>(r)];
        if (!a.empty()) msg << " Rank " << r << " is alive: " << a << ".";
        else
          msg << " Rank " << r << " did not answer within " << static_cast<int>(kAnswerWait_s)
              << " s: it is busy inside a pycomm operation's data transfer, or hung, or gone.";
      }
      if (abort_now)
        msg << " Aborting the job (PYCOMM_STALL_ABORT_S=" << stall.abort_s << "; 0 turns the abort off).";
      else if (stall.abort_s > 0)
        msg << " The job is aborted after " << stall.abort_s << " s (PYCOMM_STALL_ABORT_S).";
      std::string text = msg.str();
      if (abort_now) abort_job(text);
      log_line(text);
      warned = true;
      // Tell the waiting ranks too, so every log names the culprits.
      for (int r : present) {
        if (r == 0) continue;
        PYCOMM_MPI_CHECK(MPI_Send(text.data(), static_cast<int>(text.size()), MPI_CHAR, r, kTagStall, comm_));
      }
    }
    wait.pause();
  }

  // Ranks that leave (propose SHUTDOWN) now, ranks that left before, and the others.
  std::vector<int> leaving, gone, staying;
  for (int r = 0; r < size_; ++r) {
    if (left_[r]) gone.push_back(r);
    else if (static_cast<Collective>(all[r].front().kind) == Collective::SHUTDOWN) leaving.push_back(r);
    else staying.push_back(r);
  }
  if (!staying.empty() && (!leaving.empty() || !gone.empty())) {
    const auto& ops = all[staying.front()];
    std::ostringstream msg;
    msg << what << ": ";
    if (!leaving.empty())
      msg << rank_list(leaving) << (leaving.size() == 1 ? " has" : " have")
          << " left the job (pycomm.shutdown(), or the end of its program)";
    if (!gone.empty())
      msg << (leaving.empty() ? "" : ", and ") << rank_list(gone) << (gone.size() == 1 ? " has" : " have")
          << " left the job before";
    msg << ", while " << rank_list(staying) << (staying.size() == 1 ? " submitted " : " submitted ");
    for (size_t i = 0; i < ops.size() && i < 3; ++i) msg << (i ? ", " : "") << ops[i].describe();
    if (ops.size() > 3) msg << " and " << ops.size() - 3 << " more";
    msg << ". Operations cannot complete without every rank; end the job on every rank together.";
    std::string text = msg.str();
    const bool self_leaves = !leaving.empty() && leaving.front() == 0;
    Decision d{static_cast<int64_t>(round_), self_leaves ? kCoordinatorLeft : kError, 1,
               static_cast<int32_t>(text.size()), 0};
    std::vector<MPI_Request> reqs;
    for (int r = 1; r < size_; ++r) {
      if (left_[r]) continue;
      reqs.emplace_back();
      PYCOMM_MPI_CHECK(MPI_Isend(&d, sizeof d, MPI_BYTE, r, kTagDecide, comm_, &reqs.back()));
      reqs.emplace_back();
      PYCOMM_MPI_CHECK(MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, r, kTagText, comm_,
                                 &reqs.back()));
    }
    PYCOMM_MPI_CHECK(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
    for (int r : leaving) left_[r] = true;
    joined_.assign(static_cast<size_t>(size_), false);  // joined ranks got the error too: their join() ends
    last_joined_ = -1;
    if (self_leaves) coordinator_left_ = "rank 0, which coordinates pycomm's operations, has left the job";
    throw CommError(text);
  }

  {
    size_t decided = 0;
    if (coordinate_by_name(all, staying, what, stall, full, &decided)) return decided;
  }
  for (int r : staying)
    if (static_cast<Collective>(all[r].front().kind) == Collective::JOIN) return coordinate_join(all, what, full);

  // The operations run now: the longest prefix that every rank has ready.
  size_t count = all[0].size();
  for (int r : staying) count = std::min(count, all[r].size());
  if (staying.empty()) count = 1;  // every rank still here leaves: the shutdown round itself
  // Ranks must agree on every operation of the prefix. A disagreement past
  // the first operation shortens the prefix; it is reported in the round in
  // which that operation comes first.
  std::string error;
  for (size_t i = 0; i < count; ++i) {
    bool agree = true;
    for (int r = 1; r < size_ && agree; ++r) {
      if (left_[r]) continue;
      agree = same_call(all[r][i], all[0][i], full);
    }
    if (agree) continue;
    if (i > 0) {
      count = i;
      break;
    }
    std::map<std::string, std::vector<int>> groups;
    std::vector<std::string> order;
    for (int r = 0; r < size_; ++r) {
      if (left_[r]) continue;
      std::string d = full ? all[r][i].describe() : all[r][i].cheap().describe();
      if (!groups.count(d)) order.push_back(d);
      groups[d].push_back(r);
    }
    std::ostringstream msg;
    msg << what << ": ranks disagree on the call: ";
    for (size_t g = 0; g < order.size(); ++g) msg << (g ? "; " : "") << rank_list(groups[order[g]]) << " passed " << order[g];
    msg << ". Every rank must make the same collective calls in the same order.";
    if (!full) msg << " (check_consistency is off: only sizes are compared.)";
    error = msg.str();
    break;
  }

  Decision d{static_cast<int64_t>(round_), error.empty() ? 0 : 1, static_cast<int32_t>(error.empty() ? count : 1),
             static_cast<int32_t>(error.size()), 0};
  std::vector<MPI_Request> reqs;
  reqs.reserve(static_cast<size_t>(2 * size_));
  for (int r = 1; r < size_; ++r) {
    if (left_[r]) continue;
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
    if (stall.abort_s > 0 && waited >= stall.abort_s + 3 * kAnswerWait_s) {  // after rank 0 had its say
      abort_job("pycomm stall: rank " + std::to_string(rank_) + " aborting the job after " +
                std::to_string(static_cast<int>(waited)) + " s at " + mine.front().describe() + ".");
    }
    wait.pause();
  }
  PYCOMM_MPI_CHECK(MPI_Wait(&send, MPI_STATUS_IGNORE));
  if (d.round != static_cast<int64_t>(round_))
    throw CommError("pycomm internal error: coordination rounds out of step (" + std::to_string(d.round) + " vs " +
                    std::to_string(round_) + ")");
  join_.joined = d.joined;
  if (d.status == kPark || d.status == kRetry || d.status == kJoinSkip) {
    resolution_.kind = d.status == kPark ? Resolution::PARK : Resolution::RETRY;
    return 0;
  }
  if (d.status == kJoinDone) {
    join_.done = true;
    join_.last_rank = d.count;
    return 1;
  }
  if (d.status == kJoinRun) {
    join_.ops.resize(static_cast<size_t>(d.count));
    PYCOMM_MPI_CHECK(MPI_Recv(join_.ops.data(), static_cast<int>(join_.ops.size() * sizeof(Signature)), MPI_BYTE, 0,
                              kTagJoinOps, comm_, MPI_STATUS_IGNORE));
    return join_.ops.size();
  }
  if (d.status != kRun) {
    std::string text(static_cast<size_t>(d.text_len), '\0');
    PYCOMM_MPI_CHECK(MPI_Recv(&text[0], d.text_len, MPI_CHAR, 0, kTagText, comm_, MPI_STATUS_IGNORE));
    if (d.status == kCoordinatorLeft) coordinator_left_ = "rank 0, which coordinates pycomm's operations, has left the job";
    if (d.status == kNamed || d.status == kNamedError) {
      const size_t nul = text.find('\0');
      resolution_.kind = Resolution::NAMED;
      resolution_.name = text.substr(0, nul);
      if (d.status == kNamed) return 1;
      throw CommError(text.substr(nul + 1));
    }
    throw CommError(text);
  }
  return static_cast<size_t>(d.count);
}

// ---------------------------------------------------------------- pair_by_name

void Coordinator::send_decisions(const std::vector<int32_t>& statuses, int32_t count, const std::string& text) {
  std::vector<Decision> ds;
  ds.reserve(static_cast<size_t>(size_));
  std::vector<MPI_Request> reqs;
  for (int r = 1; r < size_; ++r) {
    if (left_[r]) continue;
    const int32_t st = statuses[static_cast<size_t>(r)];
    const bool with_text = st == kNamed || st == kNamedError || st == kError;
    ds.push_back(Decision{static_cast<int64_t>(round_), st, count,
                          static_cast<int32_t>(with_text ? text.size() : 0), 0});
    reqs.emplace_back();
    PYCOMM_MPI_CHECK(MPI_Isend(&ds.back(), sizeof(Decision), MPI_BYTE, r, kTagDecide, comm_, &reqs.back()));
    if (with_text) {
      reqs.emplace_back();
      PYCOMM_MPI_CHECK(MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, r, kTagText, comm_,
                                 &reqs.back()));
    }
  }
  PYCOMM_MPI_CHECK(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
}

bool Coordinator::coordinate_by_name(std::vector<std::vector<Signature>>& all, const std::vector<int>& staying,
                                     const char* what, const StallOptions& stall, bool full, size_t* count) {
  const size_t n = static_cast<size_t>(size_);
  // Each rank's queue head (null when it proposes parked operations only).
  std::vector<const Signature*> head(n, nullptr);
  bool parked = false, heads_agree = true, joining = false;
  const Signature* ref = nullptr;
  for (int r : staying) {
    const auto& p = all[static_cast<size_t>(r)];
    if (!p.empty() && !(p[0].flags & Signature::kParked)) head[static_cast<size_t>(r)] = &p[0];
    for (const Signature& s : p) parked = parked || (s.flags & Signature::kParked);
    const Signature* h = head[static_cast<size_t>(r)];
    if (!h) heads_agree = false;
    else if (static_cast<Collective>(h->kind) == Collective::JOIN) joining = true;
    if (h && !ref) ref = h;
    else if (h && !same_call(*h, *ref, full)) heads_agree = false;
  }
  bool named_head = false;
  for (int r : staying) {
    const Signature* h = head[static_cast<size_t>(r)];
    named_head = named_head || (h && (h->flags & Signature::kByName));
  }
  // Nothing set aside, and the heads agree or none pairs by name: the usual rule (which reports a
  // disagreement as always).
  if (!parked && (heads_agree || !named_head)) return false;
  auto strip_parked = [&] {
    for (int r : staying) {
      auto& p = all[static_cast<size_t>(r)];
      p.erase(std::remove_if(p.begin(), p.end(), [](const Signature& s) { return s.flags & Signature::kParked; }),
              p.end());
    }
  };
  auto stuck = [&](const char* why) {
    // Nothing runs this round. Report (and abort) as a missing rank would be.
    const auto now = std::chrono::steady_clock::now();
    if (stuck_since_ == std::chrono::steady_clock::time_point{}) stuck_since_ = now;
    const double waited = std::chrono::duration<double>(now - stuck_since_).count();
    const bool warn = stall.warning_s > 0 && waited >= stall.warning_s && !stuck_warned_;
    const bool abort_now = stall.abort_s > 0 && waited >= stall.abort_s;
    if (!warn && !abort_now) return;
    std::ostringstream msg;
    msg << "pycomm stall: " << what << ": for " << static_cast<int>(waited) << " s no operation could run: " << why
        << ". Operations each rank holds aside until every rank submits their names:";
    for (int r : staying) {
      msg << " rank " << r << ":";
      size_t k = 0;
      for (const Signature& s : all[static_cast<size_t>(r)])
        if (s.flags & Signature::kParked) msg << (k++ ? ", " : " ") << s.describe();
      if (k == 0) msg << " none";
      if (const Signature* h = head[static_cast<size_t>(r)]) msg << " (queue head: " << h->describe() << ")";
      msg << ";";
    }
    if (abort_now) {
      msg << " Aborting the job (PYCOMM_STALL_ABORT_S=" << stall.abort_s << ").";
      abort_job(msg.str());
    }
    log_line(msg.str());
    stuck_warned_ = true;
  };
  auto progressed = [&] {
    stuck_since_ = {};
    stuck_warned_ = false;
  };

  if (joining) {  // joined ranks answer the others' heads; what is parked waits until the join ends
    bool every_head = true;
    for (int r : staying) every_head = every_head && head[static_cast<size_t>(r)];
    strip_parked();
    if (every_head) {
      progressed();
      return false;
    }
    send_decisions(std::vector<int32_t>(n, kRetry), 0, "");
    resolution_.kind = Resolution::RETRY;
    stuck("a rank has joined (pycomm.join()) while another holds only named operations aside");
    *count = 0;
    return true;
  }

  // 1. A named operation every rank has, at its head or parked, runs now, alone: the first one
  //    found in rank order (rank 0's head, then rank 0's parked ones in order, then rank 1's ...).
  auto named = [&](int r, const char* name) -> const Signature* {
    const auto& p = all[static_cast<size_t>(r)];
    for (size_t i = 0; i < p.size(); ++i) {
      const Signature& s = p[i];
      const bool candidate = (s.flags & Signature::kParked) || (i == 0 && (s.flags & Signature::kByName));
      if (candidate && (s.flags & Signature::kByName) && std::strncmp(s.name, name, Signature::kNameLen) == 0)
        return &s;
    }
    return nullptr;
  };
  for (int r : staying) {
    const auto& p = all[static_cast<size_t>(r)];
    for (size_t i = 0; i < p.size(); ++i) {
      const Signature& s = p[i];
      if (!(s.flags & Signature::kByName) || (i > 0 && !(s.flags & Signature::kParked))) continue;
      std::vector<const Signature*> match(n, nullptr);
      bool everywhere = true;
      for (int q : staying) everywhere = everywhere && (match[static_cast<size_t>(q)] = named(q, s.name)) != nullptr;
      if (!everywhere) continue;
      std::string error;
      const Signature& first = *match[static_cast<size_t>(staying.front())];
      bool agree = true;
      for (int q : staying) agree = agree && same_call(*match[static_cast<size_t>(q)], first, full);
      if (!agree) {
        std::map<std::string, std::vector<int>> groups;
        std::vector<std::string> order;
        for (int q : staying) {
          const Signature& m = *match[static_cast<size_t>(q)];
          std::string d = full ? m.describe() : m.cheap().describe();
          if (!groups.count(d)) order.push_back(d);
          groups[d].push_back(q);
        }
        std::ostringstream msg;
        msg << what << ": ranks disagree on the call named '" << std::string(s.name) << "': ";
        for (size_t g = 0; g < order.size(); ++g)
          msg << (g ? "; " : "") << rank_list(groups[order[g]]) << " passed " << order[g];
        msg << ". Operations of the same name must match on every rank.";
        error = msg.str();
      }
      const std::string name(s.name, strnlen(s.name, Signature::kNameLen));
      send_decisions(std::vector<int32_t>(n, error.empty() ? kNamed : kNamedError), 1,
                     error.empty() ? name : name + std::string(1, '\0') + error);
      resolution_.kind = Resolution::NAMED;
      resolution_.name = name;
      progressed();
      if (!error.empty()) throw CommError(error);
      *count = 1;
      return true;
    }
  }

  // 2. Every rank has a head and they agree: the usual rule; parked operations stay aside.
  if (heads_agree) {
    strip_parked();
    progressed();
    return false;
  }

  // 3. Ranks whose head is a named operation that not every rank has set it aside; the others
  //    propose again (with what they have submitted since).
  std::vector<int32_t> statuses(n, kRetry);
  bool parks = false;
  for (int r : staying) {
    const Signature* h = head[static_cast<size_t>(r)];
    if (h && (h->flags & Signature::kByName)) statuses[static_cast<size_t>(r)] = kPark, parks = true;
  }
  if (!parks) {
    bool every_head = true;
    for (int r : staying) every_head = every_head && head[static_cast<size_t>(r)];
    if (every_head) {  // heads that pair by order disagree: the usual error
      strip_parked();
      progressed();
      return false;
    }
  }
  send_decisions(statuses, 0, "");
  resolution_.kind = statuses[0] == kPark ? Resolution::PARK : Resolution::RETRY;
  if (parks) progressed();  // a rank moved on to the operations behind its head
  else stuck("every rank's head waits for a named operation another rank has not submitted");
  *count = 0;
  return true;
}

// ---------------------------------------------------------------- join
//
// Ranks inside pycomm.join() propose JOIN every round. The others' proposals
// decide the round as usual (compared among themselves); each joined rank is
// sent the signatures of the batch and answers it with the identity of the
// reduction (zeros for sum/avg), and everyone learns how many ranks joined, so
// an average divides by the ranks that contributed. When every rank proposes
// JOIN, all are told the rank that joined last and the join ends.

namespace {

// Why a joined rank cannot answer `s` (empty: it can).
std::string unanswerable(const Signature& s, const std::vector<bool>& joined) {
  switch (static_cast<Collective>(s.kind)) {
    case Collective::ALLREDUCE:
      if (s.algorithm < 0)  // compressed_allreduce.cpp: no algorithm, the scheme leads the name ("fp16:grad")
        return "a joined rank cannot answer a compressed allreduce; reduce with compression='none' while ranks "
               "join";
      if (s.device == static_cast<int32_t>(Device::CUDA))
        return "a joined rank answers allreduces of host (CPU) tensors; this one is in device memory";
      return "";
    case Collective::BROADCAST:
      if (s.root >= 0 && static_cast<size_t>(s.root) < joined.size() && joined[static_cast<size_t>(s.root)])
        return "its root, rank " + std::to_string(s.root) + ", has joined and has nothing to send";
      return "";
    case Collective::BARRIER: return "";
    case Collective::ALLGATHER:
      if (s.ndim > Signature::kMaxDims) return "its rows have more than 6 dimensions";
      return "";  // a joined rank contributes no rows
    default:
      return "a joined rank answers allreduce, broadcast, allgather and barrier only";
  }
}

}  // namespace

size_t Coordinator::coordinate_join(const std::vector<std::vector<Signature>>& all, const char* what, bool full) {
  if (joined_.size() != static_cast<size_t>(size_)) joined_.assign(static_cast<size_t>(size_), false);
  std::vector<int> active, joining;
  int newest = -1;
  for (int r = 0; r < size_; ++r) {
    if (left_[r]) continue;
    if (static_cast<Collective>(all[r].front().kind) == Collective::JOIN) {
      joining.push_back(r);
      if (!joined_[r]) newest = r;  // of several joining in one round, the highest rank counts as last
      joined_[r] = true;
    } else {
      active.push_back(r);
    }
  }
  if (newest >= 0) last_joined_ = newest;
  const int32_t njoined = static_cast<int32_t>(joining.size());
  join_ = JoinInfo{};
  join_.joined = njoined;
  // Horovod's join (JOIN with extra = 1): allgathers and broadcasts are refused while such a rank
  // is joined, and errors reach only the ranks that made the call; the joined ranks stay joined.
  bool horovod_join = false;
  for (int r : joining) horovod_join = horovod_join || all[static_cast<size_t>(r)].front().extra == 1;
  if (active.empty()) {  // every rank has joined: the join ends everywhere
    const int last = last_joined_;
    joined_.assign(static_cast<size_t>(size_), false);
    last_joined_ = -1;
    send_join_decisions(kJoinDone, last, njoined, "", nullptr);
    join_.done = true;
    join_.last_rank = last;
    return 1;
  }

  // The ranks still running decide, exactly as in coordinate().
  const std::vector<Signature>& ref = all[active.front()];
  size_t count = ref.size();
  for (int r : active) count = std::min(count, all[r].size());
  std::string error;
  for (size_t i = 0; i < count && error.empty(); ++i) {
    bool agree = true;
    for (int r : active) agree = agree && same_call(all[r][i], ref[i], full);
    std::string why = agree ? unanswerable(ref[i], joined_) : "";
    const auto kind = static_cast<Collective>(ref[i].kind);
    if (agree && why.empty() && horovod_join && (kind == Collective::ALLGATHER || kind == Collective::BROADCAST))
      why = std::string("Horovod's join refuses ") + kind_name(ref[i].kind) + " while a rank has joined";
    if ((!agree || !why.empty()) && i > 0) {
      count = i;  // reported in the round in which it comes first
      break;
    }
    if (!agree) {
      std::map<std::string, std::vector<int>> groups;
      std::vector<std::string> order;
      for (int r : active) {
        std::string d = full ? all[r][i].describe() : all[r][i].cheap().describe();
        if (!groups.count(d)) order.push_back(d);
        groups[d].push_back(r);
      }
      std::ostringstream msg;
      msg << what << ": ranks disagree on the call: ";
      for (size_t g = 0; g < order.size(); ++g)
        msg << (g ? "; " : "") << rank_list(groups[order[g]]) << " passed " << order[g];
      msg << " (" << rank_list(joining) << (joining.size() == 1 ? " has" : " have")
          << " joined). Every rank must make the same collective calls in the same order.";
      error = msg.str();
    } else if (!why.empty()) {
      error = std::string(what) + ": " + rank_list(joining) + (joining.size() == 1 ? " has" : " have") +
              " joined (pycomm.join()) and cannot take part in " + ref[i].describe() + " submitted by " +
              rank_list(active) + ": " + why + ".";
    }
  }
  if (!error.empty() && horovod_join) {  // the callers fail; the joined ranks wait for the next round
    std::vector<int32_t> statuses(static_cast<size_t>(size_), kError);
    for (int r : joining) statuses[static_cast<size_t>(r)] = kJoinSkip;
    send_decisions(statuses, 1, error);
    if (!joined_[0]) throw CommError(error);
    resolution_.kind = Resolution::RETRY;
    return 0;
  }
  if (!error.empty()) {
    send_join_decisions(kError, 1, njoined, error, nullptr);
    joined_.assign(static_cast<size_t>(size_), false);  // every joined rank's join() raises this error
    last_joined_ = -1;
    throw CommError(error);
  }
  send_join_decisions(kRun, static_cast<int32_t>(count), njoined, "", ref.data());
  if (joined_[0]) join_.ops.assign(ref.begin(), ref.begin() + static_cast<std::ptrdiff_t>(count));
  return count;
}

void Coordinator::send_join_decisions(int32_t status, int32_t count, int32_t joined, const std::string& text,
                                      const Signature* ops) {
  std::vector<Decision> ds;
  ds.reserve(static_cast<size_t>(size_));
  std::vector<MPI_Request> reqs;
  for (int r = 1; r < size_; ++r) {
    if (left_[r]) continue;
    const int32_t st = status == kRun && joined_[r] ? kJoinRun : status;
    ds.push_back(Decision{static_cast<int64_t>(round_), st, count, static_cast<int32_t>(text.size()), joined});
    reqs.emplace_back();
    PYCOMM_MPI_CHECK(MPI_Isend(&ds.back(), sizeof(Decision), MPI_BYTE, r, kTagDecide, comm_, &reqs.back()));
    if (!text.empty()) {
      reqs.emplace_back();
      PYCOMM_MPI_CHECK(MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, r, kTagText, comm_,
                                 &reqs.back()));
    }
    if (st == kJoinRun) {
      reqs.emplace_back();
      PYCOMM_MPI_CHECK(MPI_Isend(ops, static_cast<int>(static_cast<size_t>(count) * sizeof(Signature)), MPI_BYTE, r,
                                 kTagJoinOps, comm_, &reqs.back()));
    }
  }
  PYCOMM_MPI_CHECK(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
}

}  // namespace comm
}  // namespace pycomm
