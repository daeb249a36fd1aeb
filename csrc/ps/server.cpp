#include "server.h"

#include <algorithm>
#include <cstdio>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <sys/types.h>
#include <sys/uio.h>
#include <signal.h>
#include <cstring>
#include <functional>
#include <thread>

#include "../comm/common.h"

namespace pycomm {
namespace ps {

using comm::part_size;

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

Server::Server(MPI_Comm comm, std::vector<int> workers, ServerConfig config)
    : comm_(comm), workers_(std::move(workers)), config_(config) {
  int size = 0;
  PYCOMM_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm_, &size));
  nworkers_ = static_cast<int>(workers_.size());
  worker_of_rank_.assign(static_cast<size_t>(size), -1);
  for (int i = 0; i < nworkers_; ++i) worker_of_rank_[static_cast<size_t>(workers_[static_cast<size_t>(i)])] = i;
  clocks_.assign(static_cast<size_t>(nworkers_), 0);
  done_.assign(static_cast<size_t>(nworkers_), 0);
  hist_.assign(static_cast<size_t>(nworkers_), {});
  pushes_.assign(static_cast<size_t>(nworkers_), 0);
  staleness_sum_.assign(static_cast<size_t>(nworkers_), 0);
  staleness_max_.assign(static_cast<size_t>(nworkers_), 0);
  last_seen_.assign(static_cast<size_t>(nworkers_), std::chrono::steady_clock::now());
  reported_.assign(static_cast<size_t>(nworkers_), 0);
  const char* p = std::getenv("PYCOMM_PS_PROFILE");
  profile_ = p != nullptr && *p != '\0' && std::strcmp(p, "0") != 0;
}

void Server::run() {
  // Poll with a back-off: spin while requests arrive, then sleep up to 200 us,
  // so a co-located server does not take a core from its worker when idle.
  int idle = 0;
  auto last_report_check = std::chrono::steady_clock::now();
  auto last_liveness_check = last_report_check;
  const auto liveness_every = std::chrono::duration<double>(config_.liveness_check_s);
  while (done_count_ < nworkers_) {
    if (!config_.worker_pids.empty() && config_.liveness_check_s > 0) {
      auto now = Clock::now();
      if (now - last_liveness_check >= liveness_every) {
        last_liveness_check = now;
        check_liveness();
        if (done_count_ >= nworkers_) break;
      }
    }
    int flag = 0;
    MPI_Status st;
    PYCOMM_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kTagRequest, comm_, &flag, &st));
    if (flag) {
      std::array<int64_t, kHeaderWords> h{};
      PYCOMM_MPI_CHECK(MPI_Recv(h.data(), kHeaderWords, MPI_INT64_T, st.MPI_SOURCE, kTagRequest, comm_,
                                MPI_STATUS_IGNORE));
      prof_.requests += 1;
      serve(h.data(), st.MPI_SOURCE);
      idle = 0;
      continue;
    }
    reap_sends(false);
    if (++idle > 64) {
      auto t0 = Clock::now();
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(200, 2 * (idle - 64))));
      prof_.sleep_s += since(t0);
      auto now = std::chrono::steady_clock::now();
      if (now - last_report_check > std::chrono::seconds(1)) {
        last_report_check = now;
        report_stalls();
      }
    }
  }
  reap_sends(true);
  if (profile_) print_profile();
  // Ending as if every worker had shut down would read as a finished run.
  if (!died_.empty())
    throw comm::CommError("pycomm.ps: server on rank " + std::to_string(rank_) + ": " + died_ +
                          " died before shutting the parameter server down; the run did not finish");
}

void Server::print_profile() const {
  std::fprintf(stderr,
               "pycomm.ps profile: server rank %d: %llu requests, %llu push chunks; recv-wait %.3f s, update %.3f s, "
               "copies %.3f s (%llu copy-on-write), reply tests %.3f s, idle sleep %.3f s\n",
               rank_, static_cast<unsigned long long>(prof_.requests), static_cast<unsigned long long>(prof_.chunks),
               prof_.recv_s, prof_.update_s, prof_.copy_s, static_cast<unsigned long long>(prof_.cow), prof_.reap_s,
               prof_.sleep_s);
  std::fflush(stderr);
}

namespace {
// A process that is gone or a zombie (killed, not yet reaped by its launcher).
bool process_gone(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (stat) {
    std::string line;
    std::getline(stat, line);
    size_t close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size()) {
      char state = line[close + 2];
      return state == 'Z' || state == 'X' || state == 'x';
    }
    return false;
  }
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}
}  // namespace

namespace {
// Cross-memory attach: move bytes between this process and process `pid` of this host.
// Returns 0, or the errno of the failure (EFAULT for a short transfer).
int cma_copy(bool read, pid_t pid, void* local, void* remote, size_t bytes) {
  char* l = static_cast<char*>(local);
  char* r = static_cast<char*>(remote);
  while (bytes > 0) {
    iovec li{l, bytes}, ri{r, bytes};
    ssize_t n = read ? ::process_vm_readv(pid, &li, 1, &ri, 1, 0) : ::process_vm_writev(pid, &li, 1, &ri, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EFAULT;
    l += n;
    r += n;
    bytes -= static_cast<size_t>(n);
  }
  return 0;
}
}  // namespace

int memory_probe(int pid, int64_t address, void* out, size_t bytes) {
  return cma_copy(true, static_cast<pid_t>(pid), out, reinterpret_cast<void*>(address), bytes);
}

// A worker on this host whose process has ended without kDone has died: name it
// at once (the launcher ends the job moments later; until then the others are
// no longer held back by it at a clock, and the loop ends when they are done).
void Server::check_liveness() {
  const auto& pids = config_.worker_pids;
  for (int i = 0; i < nworkers_ && static_cast<size_t>(i) < pids.size(); ++i) {
    const size_t k = static_cast<size_t>(i);
    if (done_[k] || pids[k] <= 0 || !process_gone(pids[k])) continue;
    const double silent = std::chrono::duration<double>(Clock::now() - last_seen_[k]).count();
    std::fprintf(stderr,
                 "pycomm.ps: server on rank %d: worker %d (rank %d, pid %d) has died: its process ended without "
                 "shutting the parameter server down (last request %.1f s ago, %llu push(es) applied from it); "
                 "the remaining workers continue without it, and the servers' shutdown raises\n",
                 rank_, i, workers_[k], pids[k], silent, static_cast<unsigned long long>(pushes_[k]));
    std::fflush(stderr);
    done_[k] = 1;
    reported_[k] = 1;
    ++done_count_;
    died_ += (died_.empty() ? "worker " : ", worker ") + std::to_string(i) + " (rank " + std::to_string(workers_[k]) +
             ", pid " + std::to_string(pids[k]) + ")";
    answer_clocks();
  }
}

void Server::report_stalls() {
  if (config_.stall_report_s <= 0) return;
  // Someone is waiting on the others: a clock request or a finished worker.
  if (clock_waits_.empty() && done_count_ == 0) return;
  auto now = std::chrono::steady_clock::now();
  for (int i = 0; i < nworkers_; ++i) {
    if (done_[static_cast<size_t>(i)] || reported_[static_cast<size_t>(i)]) continue;
    double silent = std::chrono::duration<double>(now - last_seen_[static_cast<size_t>(i)]).count();
    if (silent >= config_.stall_report_s) {
      std::fprintf(stderr,
                   "pycomm.ps: server on rank %d: worker %d (rank %d) has sent nothing for %.0f s while %d "
                   "worker(s) have finished and %zu wait at a clock; it may have died or stalled\n",
                   rank_, i, workers_[static_cast<size_t>(i)], silent, done_count_, clock_waits_.size());
      std::fflush(stderr);
      reported_[static_cast<size_t>(i)] = 1;
    }
  }
}

void Server::reap_sends(bool all) {
  if (outgoing_.empty()) return;
  auto t0 = Clock::now();
  for (auto it = outgoing_.begin(); it != outgoing_.end();) {
    int flag = 0;
    if (all) {
      PYCOMM_MPI_CHECK(MPI_Wait(&it->request, MPI_STATUS_IGNORE));
      flag = 1;
    } else {
      PYCOMM_MPI_CHECK(MPI_Test(&it->request, &flag, MPI_STATUS_IGNORE));
    }
    if (flag && it->from != nullptr) it->from->sending -= 1;
    it = flag ? outgoing_.erase(it) : std::next(it);
  }
  prof_.reap_s += since(t0);
}

// Replies are sent without blocking: a worker busy computing must not hold the
// server up. Shards go out zero-copy (send_shard); other data is copied.
void Server::reply(int dest, int tag, int64_t status, int64_t value, const void* data, size_t bytes, bool send_data) {
  outgoing_.emplace_back();
  Outgoing& hdr = outgoing_.back();
  hdr.words = {status, value};
  PYCOMM_MPI_CHECK(MPI_Isend(hdr.words.data(), kReplyWords, MPI_INT64_T, dest, tag, comm_, &hdr.request));
  if (send_data) send_copy(dest, tag, data, bytes);
}

void Server::send_copy(int dest, int tag, const void* data, size_t bytes) {
  if (bytes > static_cast<size_t>(INT32_MAX)) throw comm::CommError("pycomm.ps: shard reply above 2 GiB");
  auto t0 = Clock::now();
  outgoing_.emplace_back();
  Outgoing& d = outgoing_.back();
  d.bytes.resize(bytes);
  if (bytes) std::memcpy(d.bytes.data(), data, bytes);
  prof_.copy_s += since(t0);
  PYCOMM_MPI_CHECK(MPI_Isend(d.bytes.data(), static_cast<int>(bytes), MPI_BYTE, dest, tag, comm_, &d.request));
}

// The shard's weights straight from w: no copy. Until the send completes, a
// write to w goes through prepare_write.
void Server::send_shard(int dest, int tag, Shard& s) {
  const size_t bytes = s.count * sizeof(float);
  if (bytes > static_cast<size_t>(INT32_MAX)) throw comm::CommError("pycomm.ps: shard reply above 2 GiB");
  outgoing_.emplace_back();
  Outgoing& d = outgoing_.back();
  d.from = &s;
  s.sending += 1;
  PYCOMM_MPI_CHECK(MPI_Isend(s.w.data(), static_cast<int>(bytes), MPI_BYTE, dest, tag, comm_, &d.request));
}

// Before w changes: replies still reading it keep the old buffer, w continues
// on a copy (one memcpy, only when a reply is still in flight).
void Server::prepare_write(Shard& s) {
  if (s.sending == 0) return;
  reap_sends(false);
  if (s.sending == 0) return;
  auto t0 = Clock::now();
  auto keep = std::make_shared<std::vector<float>>(std::move(s.w));
  s.w = *keep;
  for (auto& o : outgoing_) {
    if (o.from != &s) continue;
    o.from = nullptr;
    o.keep = keep;
  }
  s.sending = 0;
  prof_.cow += 1;
  prof_.copy_s += since(t0);
}

// Post a receive for every chunk of count floats from source into dst, then
// hand each chunk to on_chunk(begin, n) as it lands (MPI keeps one source's
// kTagData messages in order, so chunk c is the c-th data message).
void Server::recv_chunks(float* dst, size_t count, int source, const std::function<void(size_t, size_t)>& on_chunk) {
  const size_t nchunks = (count + kChunkFloats - 1) / kChunkFloats;
  chunk_requests_.assign(nchunks, MPI_REQUEST_NULL);
  auto t_post = Clock::now();  // MPI may copy chunks that already arrived while the receive is posted
  for (size_t c = 0; c < nchunks; ++c) {
    size_t b = c * kChunkFloats, n = std::min(kChunkFloats, count - b);
    PYCOMM_MPI_CHECK(MPI_Irecv(dst + b, static_cast<int>(n * sizeof(float)), MPI_BYTE, source, kTagData, comm_,
                               &chunk_requests_[c]));
  }
  prof_.recv_s += since(t_post);
  for (size_t c = 0; c < nchunks; ++c) {
    size_t b = c * kChunkFloats, n = std::min(kChunkFloats, count - b);
    auto t0 = Clock::now();
    PYCOMM_MPI_CHECK(MPI_Wait(&chunk_requests_[c], MPI_STATUS_IGNORE));
    prof_.recv_s += since(t0);
    prof_.chunks += 1;
    if (on_chunk) on_chunk(b, n);
  }
}

// A push's chunks land in a ring of kScratchSlots chunk buffers, kept in cache:
// chunk c goes to slot c % kScratchSlots, the update reads it there, and the slot
// is reposted for chunk c + kScratchSlots. MPI matches one source's messages of
// one tag in order, so the c-th receive posted gets chunk c. Against receiving the
// whole shard into a buffer of its size, the gradient never goes to memory and back.
void Server::recv_push_chunks(size_t count, int source, const std::function<void(const float*, size_t, size_t)>& on_chunk) {
  const size_t nchunks = (count + kChunkFloats - 1) / kChunkFloats;
  const size_t slots = std::min(nchunks, kScratchSlots);
  scratch_.resize(std::max(scratch_.size(), slots * kChunkFloats));
  chunk_requests_.assign(slots, MPI_REQUEST_NULL);
  auto post = [&](size_t c) {
    size_t b = c * kChunkFloats, n = std::min(kChunkFloats, count - b);
    PYCOMM_MPI_CHECK(MPI_Irecv(scratch_.data() + (c % slots) * kChunkFloats, static_cast<int>(n * sizeof(float)),
                               MPI_BYTE, source, kTagData, comm_, &chunk_requests_[c % slots]));
  };
  auto t_post = Clock::now();
  for (size_t c = 0; c < slots; ++c) post(c);
  prof_.recv_s += since(t_post);
  for (size_t c = 0; c < nchunks; ++c) {
    size_t b = c * kChunkFloats, n = std::min(kChunkFloats, count - b);
    auto t0 = Clock::now();
    PYCOMM_MPI_CHECK(MPI_Wait(&chunk_requests_[c % slots], MPI_STATUS_IGNORE));
    prof_.recv_s += since(t0);
    prof_.chunks += 1;
    if (on_chunk) on_chunk(scratch_.data() + (c % slots) * kChunkFloats, b, n);
    if (c + slots < nchunks) post(c + slots);
  }
}

// Every initialized shard, in key order, read now (a consistent snapshot of this server).
void Server::pull_all(int dest, int tag, int worker) {
  int64_t n = 0;
  for (auto& kv : shards_) n += kv.second.initialized ? 1 : 0;
  reply(dest, tag, kOk, n, nullptr, 0, false);
  for (auto& kv : shards_) {
    Shard& s = kv.second;
    if (!s.initialized) continue;
    s.pulled_version[static_cast<size_t>(worker)] = s.version;
    if (uses_backup()) backup(s, worker);
    send_shard(dest, tag, s);
  }
}

Server::Shard& Server::shard_for(int64_t key, int64_t total, size_t count, int worker, const char* what) {
  Shard& s = shards_[key];
  (void)what;
  if (s.pulled_version.empty()) {
    s.total = total;
    s.count = count;
    s.pulled_version.assign(static_cast<size_t>(nworkers_), 0);
    s.backup.assign(static_cast<size_t>(nworkers_), {});
  }
  (void)worker;
  return s;
}

void Server::serve(const int64_t* h, int source) {
  const int worker = source < static_cast<int>(worker_of_rank_.size()) ? worker_of_rank_[static_cast<size_t>(source)] : -1;
  const int64_t op = h[kOpField];
  const int tag = static_cast<int>(h[kReplyField]);
  if (worker < 0) {
    std::fprintf(stderr, "pycomm.ps: server on rank %d: request %lld from rank %d, which is not a worker; ignored\n",
                 rank_, static_cast<long long>(op), source);
    return;
  }
  last_seen_[static_cast<size_t>(worker)] = std::chrono::steady_clock::now();
  reported_[static_cast<size_t>(worker)] = 0;
  switch (op) {
    case kInit:
    case kPush:
    case kPushLocal:
    case kPushPullLocal:
    case kPushShared:
    case kPushPullShared:
    case kLoad:
      handle_data(h, source, worker);
      return;
    case kPull:
    case kPullLocal:
    case kPullShared: {
      const bool shared = op == kPullShared;
      const bool local = op == kPullLocal || shared;  // answered with a header; the data moves in memory
      auto it = shards_.find(h[kKeyField]);
      if (op == kPullLocal && source != rank_) {
        std::fprintf(stderr, "pycomm.ps: server on rank %d: an in-process pull from rank %d; refused\n", rank_, source);
        reply(source, tag, kBadRequest, 0, nullptr, 0, false);
        return;
      }
      if (it == shards_.end() || !it->second.initialized || it->second.count != static_cast<size_t>(h[kCountField])) {
        int64_t status = (it == shards_.end() || !it->second.initialized) ? kUninitialized : kBadRequest;
        reply(source, tag, status, 0, nullptr, 0, !local);
        return;
      }
      Shard& s = it->second;
      s.pulled_version[static_cast<size_t>(worker)] = s.version;
      if (uses_backup()) backup(s, worker);
      if (local) {  // the worker waits for the answer, so its buffer is ours until then
        auto t0 = Clock::now();
        int err = 0;
        if (shared)
          err = cma_copy(false, static_cast<pid_t>(h[kPidField]), s.w.data(), reinterpret_cast<void*>(h[kArgField]),
                         s.count * sizeof(float));
        else
          std::memcpy(reinterpret_cast<float*>(h[kArgField]), s.w.data(), s.count * sizeof(float));
        prof_.copy_s += since(t0);
        if (err) report_memory_error("pull", worker, h, err);
        reply(source, tag, err ? kMemoryAccess : kOk, static_cast<int64_t>(s.version), nullptr, 0, false);
      } else {
        reply(source, tag, kOk, static_cast<int64_t>(s.version), nullptr, 0, false);
        send_shard(source, tag, s);
      }
      return;
    }
    case kClock:
    case kClockPull:
      clocks_[static_cast<size_t>(worker)] = h[kArgField];
      clock_waits_.push_back({source, tag, h[kArgField], op == kClockPull, worker});
      answer_clocks();
      return;
    case kFlush:
      reply(source, tag, kOk, 0, nullptr, 0, false);
      return;
    case kDone:
      if (!done_[static_cast<size_t>(worker)]) {
        done_[static_cast<size_t>(worker)] = 1;
        ++done_count_;
      }
      answer_clocks();  // a finished worker no longer holds anyone back
      return;
    case kStats: {
      // Per worker: kHistogramBins bins, pushes, staleness sum, max; then the sum of shard versions.
      std::vector<int64_t> words;
      for (int i = 0; i < nworkers_; ++i) {
        for (uint64_t b : hist_[static_cast<size_t>(i)]) words.push_back(static_cast<int64_t>(b));
        words.push_back(static_cast<int64_t>(pushes_[static_cast<size_t>(i)]));
        words.push_back(static_cast<int64_t>(staleness_sum_[static_cast<size_t>(i)]));
        words.push_back(static_cast<int64_t>(staleness_max_[static_cast<size_t>(i)]));
      }
      int64_t versions = 0;
      for (auto& kv : shards_) versions += static_cast<int64_t>(kv.second.version);
      words.push_back(versions);
      reply(source, tag, kOk, static_cast<int64_t>(words.size() * sizeof(int64_t)), words.data(),
            words.size() * sizeof(int64_t), true);
      return;
    }
    case kSave: {
      std::vector<char> blob = save();
      reply(source, tag, kOk, static_cast<int64_t>(blob.size()), blob.data(), blob.size(), true);
      return;
    }
    default:
      std::fprintf(stderr, "pycomm.ps: server on rank %d: unknown request %lld from rank %d; ignored\n", rank_,
                   static_cast<long long>(op), source);
  }
}

void Server::backup(Shard& s, int worker) {
  auto t0 = Clock::now();
  s.backup[static_cast<size_t>(worker)] = s.w;
  prof_.copy_s += since(t0);
}

// Staleness bookkeeping of one push and the rule it is applied with.
kernels::PsUpdate Server::begin_push(Shard& s, int worker) {
  const size_t wi = static_cast<size_t>(worker);
  // Staleness: updates of this shard since the worker last pulled it.
  const uint64_t tau = s.version - s.pulled_version[wi];
  hist_[wi][std::min<uint64_t>(tau, kHistogramBins - 1)] += 1;
  pushes_[wi] += 1;
  staleness_sum_[wi] += tau;
  staleness_max_[wi] = std::max(staleness_max_[wi], tau);
  kernels::PsUpdate u = config_.update;
  if (config_.adadelay)
    u.alpha = static_cast<float>(kernels::adadelay_alpha(config_.adadelay_L, config_.adadelay_c, s.version, tau));
  if (uses_backup() && s.backup[wi].empty()) backup(s, worker);  // never pulled: no delay to compensate
  prepare_write(s);
  return u;
}

// The rule on elements [begin, begin + n) of the shard; g points at the gradient of element begin.
// Element-wise, so chunk by chunk gives exactly the whole-shard result.
void Server::apply_push(Shard& s, int worker, const float* g, size_t begin, size_t n, const kernels::PsUpdate& u) {
  auto t0 = Clock::now();
  const float* bak = uses_backup() ? s.backup[static_cast<size_t>(worker)].data() + begin : nullptr;
  kernels::ps_update_cpu(s.w.data() + begin, s.v.empty() ? nullptr : s.v.data() + begin,
                         s.ms.empty() ? nullptr : s.ms.data() + begin, g, bak, n, u);
  prof_.update_s += since(t0);
}

void Server::handle_data(const int64_t* h, int source, int worker) {
  const int64_t op = h[kOpField];
  const int tag = static_cast<int>(h[kReplyField]);
  const size_t count = static_cast<size_t>(h[kCountField]);
  const size_t bytes = op == kLoad ? static_cast<size_t>(h[kArgField]) : count * sizeof(float);
  if (bytes > static_cast<size_t>(INT32_MAX)) throw comm::CommError("pycomm.ps: request above 2 GiB");
  if (op == kLoad) {
    std::vector<char> blob(bytes);
    PYCOMM_MPI_CHECK(MPI_Recv(blob.data(), static_cast<int>(bytes), MPI_BYTE, source, kTagData, comm_,
                              MPI_STATUS_IGNORE));
    reap_sends(true);  // no reply may still read a shard that load() replaces
    std::string error;
    bool ok = load(blob, &error);
    if (!ok) std::fprintf(stderr, "pycomm.ps: server on rank %d: cannot load state: %s\n", rank_, error.c_str());
    reply(source, tag, ok ? kOk : kBadState, 0, nullptr, 0, false);
    return;
  }
  const bool shared = op == kPushShared || op == kPushPullShared;
  const bool local = op == kPushLocal || op == kPushPullLocal || shared;  // no data messages: a reply header
  if ((op == kPushLocal || op == kPushPullLocal) && source != rank_) {
    std::fprintf(stderr, "pycomm.ps: server on rank %d: an in-process push from rank %d; refused\n", rank_, source);
    reply(source, tag, kBadRequest, 0, nullptr, 0, false);
    return;
  }
  Shard& s = shard_for(h[kKeyField], h[kTotalField], count, worker, "push");
  auto drain = [&] {  // a refused remote push still sends its chunks
    if (local) return;
    recv_push_chunks(count, source, nullptr);
  };
  if (s.count != count || s.total != h[kTotalField]) {
    // The client checks shapes before sending; this guards against mismatched clients.
    drain();
    std::fprintf(stderr, "pycomm.ps: server on rank %d: key %lld from worker %d has %zu elements, the shard has %zu; "
                 "dropped\n", rank_, static_cast<long long>(h[kKeyField]), worker, count, s.count);
    if (local) reply(source, tag, kBadRequest, 0, nullptr, 0, false);
    return;
  }
  if (op == kInit) {
    prepare_write(s);
    s.w.resize(count);
    recv_chunks(s.w.data(), count, source, nullptr);  // straight into the shard
    s.v.assign(config_.update.momentum != 0.0f ? count : 0, 0.0f);
    s.ms.assign(config_.update.comp == kernels::PsCompensation::Adaptive ? count : 0, 0.0f);
    s.version = 0;
    s.initialized = true;
    std::fill(s.pulled_version.begin(), s.pulled_version.end(), 0);
    for (auto& b : s.backup) b.clear();
    if (uses_backup()) backup(s, worker);
    return;
  }
  if (!s.initialized) {
    drain();
    std::fprintf(stderr, "pycomm.ps: server on rank %d: push of key %lld by worker %d before any init; dropped\n",
                 rank_, static_cast<long long>(h[kKeyField]), worker);
    if (local) reply(source, tag, kUninitialized, 0, nullptr, 0, false);
    return;
  }
  const kernels::PsUpdate u = begin_push(s, worker);
  if (local) {
    // The worker's own buffers (in this process, or in process `pid` of this host), used in place:
    // it waits for the answer before reusing them. Block by block: the gradient block (read into
    // a cache-sized buffer when it lives in another process) updates the shard's block, which is
    // then copied out while it is still in cache, so the shard is read once, not twice.
    constexpr size_t kBlock = kCacheBlockFloats;
    const bool pull = op == kPushPullLocal || op == kPushPullShared;
    const pid_t pid = static_cast<pid_t>(h[kPidField]);
    const float* g = reinterpret_cast<const float*>(h[kArgField]);
    float* out = reinterpret_cast<float*>(h[kOutField]);
    if (shared) bounce_.resize(kBlock);
    size_t applied = 0;
    int err = 0;
    for (size_t b = 0; b < count && err == 0; b += kBlock) {
      const size_t n = std::min(kBlock, count - b);
      const float* gb = g + b;
      if (shared) {
        auto t0 = Clock::now();
        err = cma_copy(true, pid, bounce_.data(), const_cast<float*>(g + b), n * sizeof(float));
        prof_.recv_s += since(t0);
        if (err) break;
        gb = bounce_.data();
      }
      apply_push(s, worker, gb, b, n, u);
      applied = b + n;
      if (!pull) continue;
      auto t0 = Clock::now();
      if (shared)
        err = cma_copy(false, pid, s.w.data() + b, out + b, n * sizeof(float));
      else
        std::memcpy(out + b, s.w.data() + b, n * sizeof(float));
      prof_.copy_s += since(t0);
    }
    if (applied > 0) s.version += 1;  // a push cut short by a memory error changed elements [0, applied)
    if (pull && err == 0) {
      s.pulled_version[static_cast<size_t>(worker)] = s.version;
      if (uses_backup()) backup(s, worker);
    }
    if (err) report_memory_error(pull ? "push_pull" : "push", worker, h, err, applied);
    reply(source, tag, err ? kMemoryAccess : kOk, static_cast<int64_t>(s.version), nullptr, 0, false);
    return;
  }
  recv_push_chunks(count, source,
                   [&](const float* g, size_t b, size_t n) { apply_push(s, worker, g, b, n, u); });
  s.version += 1;
}

// A worker's memory could not be read or written (its process ended, or the kernel refused):
// name it; the worker's request fails with kMemoryAccess.
void Server::report_memory_error(const char* what, int worker, const int64_t* h, int err, size_t applied) {
  std::fprintf(stderr,
               "pycomm.ps: server on rank %d: %s of key %lld by worker %d (rank %d, pid %lld): cannot reach the "
               "worker's memory (%s); %zu of %lld element(s) of its gradient were applied\n",
               rank_, what, static_cast<long long>(h[kKeyField]), worker, workers_[static_cast<size_t>(worker)],
               static_cast<long long>(h[kPidField]), std::strerror(err), applied,
               static_cast<long long>(h[kCountField]));
  std::fflush(stderr);
}

void Server::answer_clocks() {
  if (clock_waits_.empty()) return;
  int64_t min_clock = INT64_MAX;
  for (int i = 0; i < nworkers_; ++i)
    if (!done_[static_cast<size_t>(i)]) min_clock = std::min(min_clock, clocks_[static_cast<size_t>(i)]);
  const int64_t bound = config_.staleness_bound;
  for (auto it = clock_waits_.begin(); it != clock_waits_.end();) {
    if (bound < 0 || min_clock >= it->clock - bound) {
      if (it->pull)
        pull_all(it->rank, it->tag, it->worker);
      else
        reply(it->rank, it->tag, kOk, min_clock == INT64_MAX ? it->clock : min_clock, nullptr, 0, false);
      it = clock_waits_.erase(it);
    } else {
      ++it;
    }
  }
}

// ---- state: a flat little-endian blob ------------------------------------
namespace {
struct Writer {
  std::vector<char> out;
  void i64(int64_t v) { raw(&v, sizeof v); }
  void raw(const void* p, size_t n) { out.insert(out.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n); }
  void floats(const std::vector<float>& v) { i64(static_cast<int64_t>(v.size())); raw(v.data(), v.size() * sizeof(float)); }
};
struct Reader {
  const std::vector<char>& in;
  size_t pos = 0;
  bool ok = true;
  int64_t i64() { int64_t v = 0; raw(&v, sizeof v); return v; }
  void raw(void* p, size_t n) {
    if (!ok || pos + n > in.size()) { ok = false; return; }
    std::memcpy(p, in.data() + pos, n);
    pos += n;
  }
  std::vector<float> floats() {
    int64_t n = i64();
    if (n < 0 || !ok || pos + static_cast<size_t>(n) * sizeof(float) > in.size()) { ok = false; return {}; }
    std::vector<float> v(static_cast<size_t>(n));
    raw(v.data(), v.size() * sizeof(float));
    return v;
  }
};
constexpr int64_t kMagic = 0x7073736572766531;  // "psserve1"
}  // namespace

std::vector<char> Server::save() const {
  Writer w;
  w.i64(kMagic);
  w.i64(nworkers_);
  for (int i = 0; i < nworkers_; ++i) {
    w.i64(clocks_[static_cast<size_t>(i)]);
    for (uint64_t b : hist_[static_cast<size_t>(i)]) w.i64(static_cast<int64_t>(b));
    w.i64(static_cast<int64_t>(pushes_[static_cast<size_t>(i)]));
    w.i64(static_cast<int64_t>(staleness_sum_[static_cast<size_t>(i)]));
    w.i64(static_cast<int64_t>(staleness_max_[static_cast<size_t>(i)]));
  }
  w.i64(static_cast<int64_t>(shards_.size()));
  for (const auto& kv : shards_) {
    const Shard& s = kv.second;
    w.i64(kv.first);
    w.i64(s.total);
    w.i64(static_cast<int64_t>(s.count));
    w.i64(s.initialized);
    w.i64(static_cast<int64_t>(s.version));
    for (uint64_t pv : s.pulled_version) w.i64(static_cast<int64_t>(pv));
    w.floats(s.w);
    w.floats(s.v);
    w.floats(s.ms);
    for (const auto& b : s.backup) w.floats(b);
  }
  return w.out;
}

bool Server::load(const std::vector<char>& blob, std::string* error) {
  Reader r{blob};
  if (r.i64() != kMagic) return *error = "not a pycomm.ps server state", false;
  if (r.i64() != nworkers_) return *error = "the state was saved with a different number of workers", false;
  auto clocks = clocks_;
  auto hist = hist_;
  auto pushes = pushes_, sums = staleness_sum_, maxs = staleness_max_;
  for (int i = 0; i < nworkers_; ++i) {
    size_t k = static_cast<size_t>(i);
    clocks[k] = r.i64();
    for (auto& b : hist[k]) b = static_cast<uint64_t>(r.i64());
    pushes[k] = static_cast<uint64_t>(r.i64());
    sums[k] = static_cast<uint64_t>(r.i64());
    maxs[k] = static_cast<uint64_t>(r.i64());
  }
  std::map<int64_t, Shard> shards;
  int64_t n = r.i64();
  for (int64_t j = 0; r.ok && j < n; ++j) {
    int64_t key = r.i64();
    Shard& s = shards[key];
    s.total = r.i64();
    s.count = static_cast<size_t>(r.i64());
    s.initialized = r.i64() != 0;
    s.version = static_cast<uint64_t>(r.i64());
    s.pulled_version.resize(static_cast<size_t>(nworkers_));
    for (auto& pv : s.pulled_version) pv = static_cast<uint64_t>(r.i64());
    s.w = r.floats();
    s.v = r.floats();
    s.ms = r.floats();
    s.backup.resize(static_cast<size_t>(nworkers_));
    for (auto& b : s.backup) b = r.floats();
  }
  if (!r.ok || r.pos != blob.size()) return *error = "truncated or corrupt server state", false;
  clocks_ = clocks;
  hist_ = hist;
  pushes_ = pushes;
  staleness_sum_ = sums;
  staleness_max_ = maxs;
  shards_ = std::move(shards);
  return true;
}

}  // namespace ps
}  // namespace pycomm
