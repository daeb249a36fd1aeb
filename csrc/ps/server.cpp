#include "server.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "../comm/common.h"

namespace pycomm {
namespace ps {

using comm::part_size;

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
}

void Server::run() {
  // Poll with a back-off: spin while requests arrive, then sleep up to 200 us,
  // so a co-located server does not take a core from its worker when idle.
  int idle = 0;
  auto last_report_check = std::chrono::steady_clock::now();
  while (done_count_ < nworkers_) {
    int flag = 0;
    MPI_Status st;
    PYCOMM_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kTagRequest, comm_, &flag, &st));
    if (flag) {
      std::array<int64_t, kHeaderWords> h{};
      PYCOMM_MPI_CHECK(MPI_Recv(h.data(), kHeaderWords, MPI_INT64_T, st.MPI_SOURCE, kTagRequest, comm_,
                                MPI_STATUS_IGNORE));
      serve(h.data(), st.MPI_SOURCE);
      idle = 0;
      continue;
    }
    reap_sends(false);
    if (++idle > 64) {
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(200, 2 * (idle - 64))));
      auto now = std::chrono::steady_clock::now();
      if (now - last_report_check > std::chrono::seconds(1)) {
        last_report_check = now;
        report_stalls();
      }
    }
  }
  reap_sends(true);
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
  for (auto it = outgoing_.begin(); it != outgoing_.end();) {
    int flag = 0;
    if (all) {
      PYCOMM_MPI_CHECK(MPI_Wait(&it->request, MPI_STATUS_IGNORE));
      flag = 1;
    } else {
      PYCOMM_MPI_CHECK(MPI_Test(&it->request, &flag, MPI_STATUS_IGNORE));
    }
    it = flag ? outgoing_.erase(it) : std::next(it);
  }
}

// Replies are copied and sent without blocking: the shard may change right
// after, and a worker busy computing must not hold the server up.
void Server::reply(int dest, int tag, int64_t status, int64_t value, const void* data, size_t bytes, bool send_data) {
  outgoing_.emplace_back();
  Outgoing& hdr = outgoing_.back();
  hdr.bytes.resize(sizeof(int64_t) * kReplyWords);
  int64_t words[kReplyWords] = {status, value};
  std::memcpy(hdr.bytes.data(), words, sizeof(words));
  PYCOMM_MPI_CHECK(MPI_Isend(hdr.bytes.data(), kReplyWords, MPI_INT64_T, dest, tag, comm_, &hdr.request));
  if (send_data) send_copy(dest, tag, data, bytes);
}

void Server::send_copy(int dest, int tag, const void* data, size_t bytes) {
  if (bytes > static_cast<size_t>(INT32_MAX)) throw comm::CommError("pycomm.ps: shard reply above 2 GiB");
  outgoing_.emplace_back();
  Outgoing& d = outgoing_.back();
  d.bytes.resize(bytes);
  if (bytes) std::memcpy(d.bytes.data(), data, bytes);
  PYCOMM_MPI_CHECK(MPI_Isend(d.bytes.data(), static_cast<int>(bytes), MPI_BYTE, dest, tag, comm_, &d.request));
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
    if (uses_backup()) s.backup[static_cast<size_t>(worker)] = s.w;
    send_copy(dest, tag, s.w.data(), s.count * sizeof(float));
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
    case kLoad:
      handle_data(h, source, worker);
      return;
    case kPull: {
      auto it = shards_.find(h[kKeyField]);
      if (it == shards_.end() || !it->second.initialized || it->second.count != static_cast<size_t>(h[kCountField])) {
        int64_t status = (it == shards_.end() || !it->second.initialized) ? kUninitialized : kBadRequest;
        reply(source, tag, status, 0, nullptr, 0, true);
        return;
      }
      Shard& s = it->second;
      s.pulled_version[static_cast<size_t>(worker)] = s.version;
      if (uses_backup()) s.backup[static_cast<size_t>(worker)] = s.w;
      reply(source, tag, kOk, static_cast<int64_t>(s.version), s.w.data(), s.count * sizeof(float), true);
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

void Server::handle_data(const int64_t* h, int source, int worker) {
  const int64_t op = h[kOpField];
  const size_t count = static_cast<size_t>(h[kCountField]);
  const size_t bytes = op == kLoad ? static_cast<size_t>(h[kArgField]) : count * sizeof(float);
  if (bytes > static_cast<size_t>(INT32_MAX)) throw comm::CommError("pycomm.ps: request above 2 GiB");
  if (op == kLoad) {
    std::vector<char> blob(bytes);
    PYCOMM_MPI_CHECK(MPI_Recv(blob.data(), static_cast<int>(bytes), MPI_BYTE, source, kTagData, comm_,
                              MPI_STATUS_IGNORE));
    std::string error;
    bool ok = load(blob, &error);
    if (!ok) std::fprintf(stderr, "pycomm.ps: server on rank %d: cannot load state: %s\n", rank_, error.c_str());
    reply(source, static_cast<int>(h[kReplyField]), ok ? kOk : kBadState, 0, nullptr, 0, false);
    return;
  }
  scratch_.resize(count);
  PYCOMM_MPI_CHECK(MPI_Recv(scratch_.data(), static_cast<int>(bytes), MPI_BYTE, source, kTagData, comm_,
                            MPI_STATUS_IGNORE));
  Shard& s = shard_for(h[kKeyField], h[kTotalField], count, worker, "push");
  if (s.count != count || s.total != h[kTotalField]) {
    // The client checks shapes before sending; this guards against mismatched clients.
    std::fprintf(stderr, "pycomm.ps: server on rank %d: key %lld from worker %d has %zu elements, the shard has %zu; "
                 "dropped\n", rank_, static_cast<long long>(h[kKeyField]), worker, count, s.count);
    return;
  }
  const size_t wi = static_cast<size_t>(worker);
  if (op == kInit) {
    s.w.assign(scratch_.begin(), scratch_.end());
    s.v.assign(config_.update.momentum != 0.0f ? count : 0, 0.0f);
    s.ms.assign(config_.update.comp == kernels::PsCompensation::Adaptive ? count : 0, 0.0f);
    s.version = 0;
    s.initialized = true;
    std::fill(s.pulled_version.begin(), s.pulled_version.end(), 0);
    for (auto& b : s.backup) b.clear();
    if (uses_backup()) s.backup[wi] = s.w;
    return;
  }
  if (!s.initialized) {
    std::fprintf(stderr, "pycomm.ps: server on rank %d: push of key %lld by worker %d before any init; dropped\n",
                 rank_, static_cast<long long>(h[kKeyField]), worker);
    return;
  }
  // Staleness: updates of this shard since the worker last pulled it.
  const uint64_t tau = s.version - s.pulled_version[wi];
  hist_[wi][std::min<uint64_t>(tau, kHistogramBins - 1)] += 1;
  pushes_[wi] += 1;
  staleness_sum_[wi] += tau;
  staleness_max_[wi] = std::max(staleness_max_[wi], tau);
  kernels::PsUpdate u = config_.update;
  if (config_.adadelay)
    u.alpha = static_cast<float>(kernels::adadelay_alpha(config_.adadelay_L, config_.adadelay_c, s.version, tau));
  const float* bak = nullptr;
  if (uses_backup()) {
    if (s.backup[wi].empty()) s.backup[wi] = s.w;  // never pulled: no delay to compensate
    bak = s.backup[wi].data();
  }
  kernels::ps_update_cpu(s.w.data(), s.v.empty() ? nullptr : s.v.data(), s.ms.empty() ? nullptr : s.ms.data(),
                         scratch_.data(), bak, count, u);
  s.version += 1;
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
