// Synchronous SGD with backup workers (Chen et al. 2016; docs/algorithms.md §4): N + B ranks, each
// step averages the first N gradients to arrive and drops the other B.
//
// Schedule. A session is one engine operation on every rank, opened by one ordinary coordination
// round (kind BACKUP; the ranks must agree on the name, the element count n, B and the first step,
// else CommError on every rank). From then on the engine thread of every rank runs the loop below
// until every rank has closed; its Python thread computes meanwhile and hands gradients in
// (BackupSession::submit) without waiting for anyone. Step k (N = size - B):
//
//   rank r, once its Python thread has handed in gradient k:  READY(k) -> rank 0, sent by that
//          thread (by the engine thread for a gradient handed in before the session ran); rank 0
//          notes its own gradient after the READYs that reached it in the same pass of its loop
//   rank 0 (the coordinator), in the order the READYs reach it (its own included): the first N
//          ranks are the step's counted set C_k; it sends RUN(k, C_k) to every other rank at once,
//          without waiting for the other B
//   every rank, on RUN(k, C_k): x_r = g_r(k) if r in C_k, else 0 (the engine threads of the B late
//          ranks take part with zeros, the way a joined rank does, engine_join.cpp);
//          sum = allreduce(x) over all N + B ranks (the engine's float32 allreduce, algorithm auto);
//          avg_k = sum / N  (divided by the N counted gradients, not by N + B);
//          avg_k and C_k are kept for the Python thread, which takes the steps in order.
//
// A late rank's READY(k) reaches rank 0 after RUN(k) left: rank 0 drops it (READYs carry k). A late
// rank's Python thread that hands in gradient k after RUN(k) was decided gets avg_k at once and its
// gradient is dropped (submit returns false); one that finds avg_k already in before computing
// skips the step's forward and backward (BackupSGD.step_decided()). The fast ranks never wait for a
// late rank's backward pass: only for the data exchange, in which the late rank's engine thread
// takes part while its Python thread computes. Every rank applies the same avg_k, so every rank
// continues from the same model.
//
// Leaving: each rank's Python thread closes after its last step (CLOSE(steps taken) -> rank 0);
// when every rank has closed after the same number of steps rank 0 sends DONE and the session
// ends. A rank that closed while others hand in further steps, or counts that differ, end the
// session with a CommError on every rank (ABORT, with the text); so does an operation submitted
// on any rank while its session runs, and a failure on any rank (FAIL(text) -> rank 0 -> ABORT).
// Rank 0 reports a step that waits longer than the stall warning (PYCOMM_STALL_WARNING_S) for its
// N gradients, naming the ranks it has, and aborts the job after the stall abort limit, as the
// coordination rounds do (coordinator.h).
//
// Bytes per step, S = 4 n: control messages on the coordinator's communicator, 24 bytes up per rank
// that hands in (READY) and 24 + (N + B) bytes down to each other rank (RUN); data: one float32
// allreduce of S among all N + B ranks, 2 (N + B - 1)/(N + B) S sent per rank with the ring (the
// late ranks send zeros of the same size: the exchange cannot shrink to the N counted ranks
// without a communicator per counted set, and the late ranks need avg_k to continue). Per session:
// the opening round (the engine's usual two messages per rank), CLOSE and DONE (24 bytes each).
#include "backup_allreduce.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "../kernels/reduce.h"
#include "engine.h"

namespace pycomm {
namespace comm {
namespace {

constexpr int kTagBackupUp = 108;    // rank -> rank 0: READY / CLOSE / FAIL (coordinator.cpp uses 101-107)
constexpr int kTagBackupDown = 109;  // rank 0 -> rank: RUN / DONE / ABORT

enum UpType : int64_t { kReady = 1, kClose = 2, kFail = 3 };
enum DownType : int64_t { kRunStep = 1, kDone = 2, kAbort = 3 };

// Every message: this header, then (RUN) one byte per rank, 1 = counted, or (FAIL, ABORT) the text.
struct Header {
  int64_t session;  // the coordination round that opened the session: the same on every rank
  int64_t type;
  int64_t value;    // READY, RUN: the step; CLOSE: the steps taken
};

std::vector<char> message(int64_t session, int64_t type, int64_t value, const void* tail, size_t tail_bytes) {
  std::vector<char> m(sizeof(Header) + tail_bytes);
  Header h{session, type, value};
  std::memcpy(m.data(), &h, sizeof h);
  if (tail_bytes) std::memcpy(m.data() + sizeof h, tail, tail_bytes);
  return m;
}

// Receive the message `st` announced; its header and tail.
Header receive(MPI_Comm comm, const MPI_Status& st, int tag, std::string* tail) {
  int bytes = 0;
  PYCOMM_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &bytes));
  std::vector<char> m(static_cast<size_t>(std::max(bytes, 0)));
  PYCOMM_MPI_CHECK(MPI_Recv(m.data(), bytes, MPI_BYTE, st.MPI_SOURCE, tag, comm, MPI_STATUS_IGNORE));
  Header h{-1, 0, 0};
  if (m.size() >= sizeof h) {
    std::memcpy(&h, m.data(), sizeof h);
    tail->assign(m.data() + sizeof h, m.size() - sizeof h);
  }
  return h;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? "," : "") << ranks[i];
  return ranks.empty() ? "no rank" : s.str();
}

}  // namespace

// ---------------------------------------------------------------- the session (shared state)

BackupSession::BackupSession(size_t numel, int backups, int64_t first_step, std::string name)
    : numel_(numel), backups_(backups), first_step_(first_step), name_(std::move(name)),
      next_step_(first_step), taken_(first_step) {
  if (backups < 0) throw CommError("backup session: backups must be >= 0, got " + std::to_string(backups));
  if (first_step < 0) throw CommError("backup session: first_step must be >= 0");
}

void BackupSession::throw_if_ended_locked() {
  if (!ended_) return;
  if (error_) std::rethrow_exception(error_);
  throw CommError("backup session '" + name_ + "' has ended (closed on every rank)");
}

bool BackupSession::ready(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  return step < next_step_;
}

bool BackupSession::submit(const float* grad, int64_t step) {
  std::unique_lock<std::mutex> lock(mu_);
  throw_if_ended_locked();
  if (close_count_ >= 0) throw CommError("backup session '" + name_ + "': submit after close");
  if (step != taken_)
    throw CommError("backup session '" + name_ + "': gradient for step " + std::to_string(step) +
                    ", but this rank's next step is " + std::to_string(taken_) + " (steps are taken in order)");
  if (slot_step_ == step) throw CommError("backup session '" + name_ + "': step " + std::to_string(step) +
                                          " was handed in twice");
  if (step < next_step_) return false;  // decided without this rank: dropped
  slot_.assign(grad, grad + numel_);
  slot_step_ = step;
  // READY(step) to rank 0 from this thread, once the session runs (before, the engine thread sends it).
  const bool announce = rank_ > 0 && session_ >= 0 && announced_ != step;
  if (!announce) return true;
  announced_ = step;
  const MPI_Comm ctl = control_;
  const int64_t sid = session_;
  lock.unlock();
  std::vector<char> m = message(sid, kReady, step, nullptr, 0);
  PYCOMM_MPI_CHECK(MPI_Send(m.data(), static_cast<int>(m.size()), MPI_BYTE, 0, kTagBackupUp, ctl));
  return true;
}

void BackupSession::start(MPI_Comm control, int rank, int64_t session) {
  std::lock_guard<std::mutex> lock(mu_);
  control_ = control;
  rank_ = rank;
  session_ = session;
}

bool BackupSession::take_announcement(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot_step_ != step || announced_ == step) return false;
  announced_ = step;
  return true;
}

bool BackupSession::take(int64_t step, float* out, std::vector<int>* counted) {
  std::unique_lock<std::mutex> lock(mu_);
  if (step != taken_)
    throw CommError("backup session '" + name_ + "': take step " + std::to_string(step) + ", but this rank's next "
                    "step is " + std::to_string(taken_));
  cv_.wait(lock, [this] { return ended_ || !results_.empty(); });
  if (results_.empty()) throw_if_ended_locked();
  Step& s = results_.front();
  if (s.step != step) throw CommError("pycomm internal error: backup session results out of order");
  if (numel_) std::memcpy(out, s.average.data(), numel_ * sizeof(float));
  *counted = std::move(s.counted);
  const bool mine = s.mine;
  results_.pop_front();
  ++taken_;
  return mine;
}

void BackupSession::close(int64_t steps_taken) {
  std::lock_guard<std::mutex> lock(mu_);
  if (close_count_ < 0) close_count_ = steps_taken;
}

bool BackupSession::has_gradient(int64_t step, int64_t* close_count) {
  std::lock_guard<std::mutex> lock(mu_);
  *close_count = close_count_;
  return slot_step_ == step;
}

bool BackupSession::local_gradient(int64_t step, float* dst, int64_t* close_count) {
  std::lock_guard<std::mutex> lock(mu_);
  *close_count = close_count_;
  if (slot_step_ != step) return false;
  if (numel_) std::memcpy(dst, slot_.data(), numel_ * sizeof(float));
  return true;
}

void BackupSession::push(Step s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (slot_step_ == s.step) slot_step_ = -1;  // counted or dropped: either way done with
    next_step_ = s.step + 1;
    results_.push_back(std::move(s));
  }
  cv_.notify_all();
}

void BackupSession::end(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return;
    ended_ = true;
    error_ = error;
  }
  cv_.notify_all();
}

bool BackupSession::ended() {
  std::lock_guard<std::mutex> lock(mu_);
  return ended_;
}

// ---------------------------------------------------------------- the engine's side

WorkPtr Engine::backup_session(std::shared_ptr<BackupSession> session) {
  Signature sig;
  sig.kind = static_cast<int32_t>(Collective::BACKUP);
  sig.dtype = static_cast<int32_t>(DType::F32);
  sig.numel = static_cast<int64_t>(session->numel());
  sig.ndim = 1;
  sig.dims[0] = sig.numel;
  sig.root = session->backups();  // kept by Signature::cheap(): B is compared even without check_consistency
  sig.extra = static_cast<int32_t>(session->first_step());
  sig.set_name(session->name());
  BackupSession* s = session.get();
  WorkPtr work = submit_custom(sig, "backup session", session->name(), session,
                               [this, s] { run_backup_session(*s); }, false);
  // However the operation ends (DONE, an error in its round or in the loop), the Python thread's
  // take() and submit() learn it.
  work->then([session](std::exception_ptr error) { session->end(error); });
  return work;
}

void Engine::run_backup_session(BackupSession& s) {
  MPI_Comm ctl = coordinator_.control();
  int rank = 0, size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_rank(ctl, &rank));
  PYCOMM_MPI_CHECK(MPI_Comm_size(ctl, &size));
  const int n_counted = size - s.backups();
  const std::string what = "pycomm backup session '" + s.name() + "'";
  if (n_counted < 1)
    throw CommError(what + ": " + std::to_string(s.backups()) + " backup workers leave no gradient to count in a job of " +
                    std::to_string(size) + " rank(s); B must be below the number of ranks");
  const int64_t sid = static_cast<int64_t>(coordinator_.rounds());  // the opening round: the same everywhere
  const size_t n = s.numel();
  s.start(ctl, rank, sid);

  int64_t k = s.first_step();
  bool sent_ready = false, sent_close = false;
  std::string local_failure;
  // rank 0: the step's arrivals in order, each rank's close count, a failure to pass on
  std::vector<int> arrivals;
  std::vector<char> arrived(static_cast<size_t>(size), 0);
  std::vector<int64_t> closed(static_cast<size_t>(size), -1);
  std::string failure;
  Backoff wait;
  auto step_began = std::chrono::steady_clock::now();
  bool warned = false;

  auto send_up = [&](int64_t type, int64_t value, const std::string& text) {
    std::vector<char> m = message(sid, type, value, text.data(), text.size());
    PYCOMM_MPI_CHECK(MPI_Send(m.data(), static_cast<int>(m.size()), MPI_BYTE, 0, kTagBackupUp, ctl));
  };
  auto send_down_all = [&](int64_t type, int64_t value, const void* tail, size_t tail_bytes) {
    std::vector<char> m = message(sid, type, value, tail, tail_bytes);
    std::vector<MPI_Request> reqs;
    for (int r = 1; r < size; ++r) {
      reqs.emplace_back();
      PYCOMM_MPI_CHECK(MPI_Isend(m.data(), static_cast<int>(m.size()), MPI_BYTE, r, kTagBackupDown, ctl, &reqs.back()));
    }
    PYCOMM_MPI_CHECK(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
  };
  // Step k on every rank: this rank's gradient if counted, else zeros; sum over all ranks; / N.
  auto run_step = [&](const std::vector<char>& mask) {
    BackupSession::Step st;
    st.step = k;
    for (int r = 0; r < size; ++r)
      if (mask[static_cast<size_t>(r)]) st.counted.push_back(r);
    st.mine = mask[static_cast<size_t>(rank)] != 0;
    st.average.assign(n, 0.0f);
    int64_t cc = -1;
    if (st.mine && !s.local_gradient(k, st.average.data(), &cc))
      throw CommError("pycomm internal error: " + what + ": rank " + std::to_string(rank) + " counted at step " +
                      std::to_string(k) + " without a gradient");
    if (n > 0 && size > 1) {
      AllreduceArgs a;
      a.input = a.output = Buffer{st.average.data(), n, DType::F32, Device::CPU, -1};
      a.op = ReduceOp::SUM;
      a.average = false;
      a.algorithm = Algorithm::AUTO;
      a.name = s.name();
      exec_->allreduce(a);
    }
    if (n > 0 && n_counted > 1) kernels::scale_cpu(st.average.data(), n, DType::F32, 1.0 / n_counted);
    s.push(std::move(st));
    ++k;
    sent_ready = false;
    arrivals.clear();
    std::fill(arrived.begin(), arrived.end(), 0);
    step_began = std::chrono::steady_clock::now();
    warned = false;
  };

  for (;;) {
    bool progress = false;
    // ---- this rank: its gradient, its close, anything submitted behind the session
    int64_t close_count = -1;
    const bool have = s.has_gradient(k, &close_count);
    if (local_failure.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      const size_t mine = std::max<size_t>(running_, 1);
      if (queue_.size() > mine)
        local_failure = what + ": rank " + std::to_string(rank) + " submitted " + queue_[mine].sig.describe() +
                        " while its backup session runs; the engine runs nothing else until every rank has closed the "
                        "session (BackupSGD.settle(), finalize(); pycomm-train settles at each epoch's end and checkpoint)";
      if (!local_failure.empty() && rank != 0) send_up(kFail, k, local_failure);
    }
    // Rank 0's own gradient is registered after the messages drained below, so that in a pass that
    // finds both, the ranks whose READY had to travel come first. The others' READYs normally leave
    // from submit(); one handed in before the session ran leaves here.
    const bool own_arrival = rank == 0 && have && !sent_ready;
    if (rank != 0 && have && !sent_ready) {
      if (s.take_announcement(k)) send_up(kReady, k, "");
      sent_ready = true;
      progress = true;
    }
    if (close_count >= 0 && !sent_close) {
      if (rank == 0) closed[0] = close_count;
      else send_up(kClose, close_count, "");
      sent_close = true;
      progress = true;
    }

    if (rank == 0) {
      // ---- the coordinator: arrivals in order, closes, failures
      for (;;) {
        int flag = 0;
        MPI_Status st;
        PYCOMM_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kTagBackupUp, ctl, &flag, &st));
        if (!flag) break;
        std::string text;
        const Header h = receive(ctl, st, kTagBackupUp, &text);
        progress = true;
        if (h.session != sid) continue;  // from an earlier session that ended in an error
        const int src = st.MPI_SOURCE;
        if (h.type == kReady) {
          if (h.value == k && !arrived[static_cast<size_t>(src)]) arrived[static_cast<size_t>(src)] = 1, arrivals.push_back(src);
          else if (h.value > k && failure.empty())
            failure = "pycomm internal error: " + what + ": rank " + std::to_string(src) + " is ready for step " +
                      std::to_string(h.value) + " while step " + std::to_string(k) + " is undecided";
          // h.value < k: a late rank's gradient for a step decided without it (dropped there)
        } else if (h.type == kClose) {
          closed[static_cast<size_t>(src)] = h.value;
        } else if (h.type == kFail && failure.empty()) {
          failure = text;
        }
      }
      if (own_arrival) {
        if (!arrived[0]) arrived[0] = 1, arrivals.push_back(0);
        sent_ready = true;
        progress = true;
      }
      if (failure.empty() && !local_failure.empty()) failure = local_failure;
      if (failure.empty()) {  // a rank that closed while the others go on, or closes after other step counts
        std::vector<int> short_ranks;
        for (int r = 0; r < size; ++r)
          if (closed[static_cast<size_t>(r)] >= 0 && (closed[static_cast<size_t>(r)] != k || !arrivals.empty()))
            short_ranks.push_back(r);
        if (!short_ranks.empty()) {
          std::ostringstream m;
          m << what << ": ranks took different numbers of steps:";
          for (int r = 0; r < size; ++r) {
            if (closed[static_cast<size_t>(r)] >= 0) m << " rank " << r << " closed after " << closed[static_cast<size_t>(r)] << ";";
            else if (arrived[static_cast<size_t>(r)]) m << " rank " << r << " handed in step " << k << ";";
          }
          m << " every rank must take the same steps (the counted ones and the dropped ones alike)";
          failure = m.str();
        }
      }
      if (!failure.empty()) {
        send_down_all(kAbort, k, failure.data(), failure.size());
        throw CommError(failure);
      }
      if (static_cast<int>(arrivals.size()) >= n_counted) {
        std::vector<char> mask(static_cast<size_t>(size), 0);
        for (int i = 0; i < n_counted; ++i) mask[static_cast<size_t>(arrivals[static_cast<size_t>(i)])] = 1;
        send_down_all(kRunStep, k, mask.data(), mask.size());
        run_step(mask);
        wait = Backoff();
        continue;
      }
      if (std::all_of(closed.begin(), closed.end(), [&](int64_t c) { return c == k; })) {
        send_down_all(kDone, k, nullptr, 0);
        return;
      }
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_began).count();
      const StallOptions& stall = active_.stall;
      const bool abort_now = stall.abort_s > 0 && waited >= stall.abort_s;
      if ((!warned && stall.warning_s > 0 && waited >= stall.warning_s) || abort_now) {
        std::vector<int> missing;
        for (int r = 0; r < size; ++r)
          if (!arrived[static_cast<size_t>(r)] && closed[static_cast<size_t>(r)] < 0) missing.push_back(r);
        std::ostringstream m;
        m << "pycomm stall: " << what << " step " << k << " has waited " << static_cast<int>(waited) << " s for "
          << n_counted << " gradients; it has " << arrivals.size() << " (" << rank_list(arrivals) << "), "
          << rank_list(missing) << " have not handed theirs in.";
        if (abort_now) {
          m << " Aborting the job (PYCOMM_STALL_ABORT_S=" << stall.abort_s << ").";
          abort_job(m.str());
        }
        std::fprintf(stderr, "%s\n", m.str().c_str());
        std::fflush(stderr);
        warned = true;
      }
    } else {
      // ---- the other ranks: rank 0's decisions
      int flag = 0;
      MPI_Status st;
      PYCOMM_MPI_CHECK(MPI_Iprobe(0, kTagBackupDown, ctl, &flag, &st));
      if (flag) {
        std::string tail;
        const Header h = receive(ctl, st, kTagBackupDown, &tail);
        if (h.session == sid) {
          if (h.type == kAbort) throw CommError(tail);
          if (h.type == kDone) return;
          if (h.type != kRunStep || h.value != k || tail.size() != static_cast<size_t>(size))
            throw CommError("pycomm internal error: " + what + ": unexpected decision for step " +
                            std::to_string(h.value) + " at step " + std::to_string(k));
          run_step(std::vector<char>(tail.begin(), tail.end()));
          wait = Backoff();
          continue;
        }
      }
    }
    if (progress) wait = Backoff();
    else wait.pause();
  }
}

}  // namespace comm
}  // namespace pycomm
