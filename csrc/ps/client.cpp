#include "client.h"

#include <algorithm>
#include <cstdint>
#include <thread>
#include <unistd.h>

#include "../comm/common.h"

namespace pycomm {
namespace ps {

using comm::part_begin;
using comm::part_size;

Request::~Request() {
  // A request dropped unfinished is completed here: MPI still owns its buffers.
  if (!done_) {
    try {
      wait();
    } catch (...) {
    }
  }
}

namespace {
// MPI_Waitall busy-polls; a worker waiting on its own server thread (co-located)
// would take the core that thread needs. Test, spin a little, then yield.
void wait_all(std::vector<MPI_Request>& reqs) {
  for (int spin = 0;; ++spin) {
    int flag = 0;
    PYCOMM_MPI_CHECK(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE));
    if (flag) return;
    if (spin >= 16) std::this_thread::yield();
  }
}
}  // namespace

bool Request::test() {
  if (done_) return true;
  int flag = 0;
  PYCOMM_MPI_CHECK(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE));
  if (!flag) return false;
  wait();
  return true;
}

int64_t Request::wait() {
  if (!done_) {
    wait_all(requests_);
    if (two_phase_) {  // the reply told the payload size: receive it now
      payloads_.resize(replies_.size());
      std::vector<MPI_Request> reqs(replies_.size(), MPI_REQUEST_NULL);
      for (size_t j = 0; j < replies_.size(); ++j) {
        int64_t bytes = replies_[j][0] == kOk ? replies_[j][1] : 0;
        payloads_[j].resize(static_cast<size_t>(bytes));
        PYCOMM_MPI_CHECK(MPI_Irecv(payloads_[j].data(), static_cast<int>(bytes), MPI_BYTE, reply_from_[j], tag_,
                                   comm_, &reqs[j]));
      }
      wait_all(reqs);
    }
    done_ = true;
  }
  for (size_t j = 0; j < replies_.size(); ++j) {
    if (replies_[j][0] != kOk) return replies_[j][0];
    if (!expect_shards_.empty() && replies_[j][1] != expect_shards_[j]) return kBadRequest;
  }
  return kOk;
}

Client::Client(MPI_Comm comm, std::vector<int> servers) : comm_(comm), servers_(std::move(servers)) {
  if (servers_.empty()) throw comm::CommError("pycomm.ps: no servers");
  PYCOMM_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  shared_.assign(servers_.size(), 0);
  pid_ = static_cast<int64_t>(::getpid());
}

void Client::set_shared(const std::vector<int>& server_indices) {
  std::fill(shared_.begin(), shared_.end(), 0);
  for (int j : server_indices) {
    if (j < 0 || j >= num_servers()) throw comm::CommError("pycomm.ps: set_shared: no server index " + std::to_string(j));
    shared_[static_cast<size_t>(j)] = servers_[static_cast<size_t>(j)] != rank_;
  }
}

int Client::next_tag() {
  tag_counter_ = (tag_counter_ + 1) % kReplyTagCount;
  return kReplyTagBase + tag_counter_;
}

std::unique_ptr<Request> Client::start() {
  auto r = std::unique_ptr<Request>(new Request());
  r->comm_ = comm_;
  r->tag_ = next_tag();
  // Reserve so that header/reply addresses handed to MPI stay valid (push_pull: two headers a server).
  r->headers_.reserve(2 * servers_.size());
  r->replies_.reserve(servers_.size());
  r->requests_.reserve(3 * servers_.size());
  return r;
}

void Client::send_header(Request& r, int server, int64_t op, int64_t key, int64_t total, int64_t count, int64_t arg,
                         int64_t out, int64_t pid) {
  r.headers_.push_back({op, key, total, count, arg, r.tag_, out, pid});
  r.requests_.emplace_back();
  PYCOMM_MPI_CHECK(MPI_Isend(r.headers_.back().data(), kHeaderWords, MPI_INT64_T, server, kTagRequest, comm_,
                             &r.requests_.back()));
}

// A request answered by a header only, its data addressed where it is: in this process (in_process_op),
// or in this process as seen from a server of this host (shared_op, with this process's pid).
void Client::send_direct(Request& r, int j, int64_t in_process_op, int64_t shared_op, int64_t key, int64_t total,
                         size_t n, const float* arg, const float* out) {
  const bool here = servers_[static_cast<size_t>(j)] == rank_;
  expect_reply(r, servers_[static_cast<size_t>(j)]);
  send_header(r, servers_[static_cast<size_t>(j)], here ? in_process_op : shared_op, key, total,
              static_cast<int64_t>(n), static_cast<int64_t>(reinterpret_cast<intptr_t>(arg)),
              static_cast<int64_t>(reinterpret_cast<intptr_t>(out)), here ? 0 : pid_);
}

void Client::expect_reply(Request& r, int server) {
  r.replies_.push_back({kOk, 0});
  r.reply_from_.push_back(server);
  r.requests_.emplace_back();
  PYCOMM_MPI_CHECK(MPI_Irecv(r.replies_.back().data(), kReplyWords, MPI_INT64_T, server, r.tag_, comm_,
                             &r.requests_.back()));
}

static int checked_count(size_t n) {
  if (n > static_cast<size_t>(INT32_MAX) / sizeof(float))
    throw comm::CommError("pycomm.ps: a shard above 2 GiB; use more servers");
  return static_cast<int>(n * sizeof(float));
}

// The shard's data in chunks of kChunkFloats, all in flight at once.
void Client::send_chunks(Request& r, int server, const float* data, size_t n) {
  checked_count(n);
  for (size_t b = 0; b < n; b += kChunkFloats) {
    size_t m = std::min(kChunkFloats, n - b);
    r.requests_.emplace_back();
    PYCOMM_MPI_CHECK(MPI_Isend(data + b, static_cast<int>(m * sizeof(float)), MPI_BYTE, server, kTagData, comm_,
                               &r.requests_.back()));
  }
}

std::unique_ptr<Request> Client::init(int64_t key, int64_t total, const float* data) {
  auto r = start();
  const int K = num_servers();
  for (int j = 0; j < K; ++j) {
    size_t b = part_begin(static_cast<size_t>(total), K, j), n = part_size(static_cast<size_t>(total), K, j);
    if (n == 0) continue;
    send_header(*r, servers_[j], kInit, key, total, static_cast<int64_t>(n), 0);
    send_chunks(*r, servers_[j], data + b, n);
  }
  return r;
}

std::unique_ptr<Request> Client::push(int64_t key, int64_t total, const float* data) {
  auto r = start();
  const int K = num_servers();
  for (int j = 0; j < K; ++j) {
    size_t b = part_begin(static_cast<size_t>(total), K, j), n = part_size(static_cast<size_t>(total), K, j);
    if (n == 0) continue;
    if (direct(j)) {  // the server reads the gradient where it is
      send_direct(*r, j, kPushLocal, kPushShared, key, total, n, data + b, nullptr);
      continue;
    }
    send_header(*r, servers_[j], kPush, key, total, static_cast<int64_t>(n), 0);
    send_chunks(*r, servers_[j], data + b, n);
  }
  return r;
}

std::unique_ptr<Request> Client::pull(int64_t key, int64_t total, float* out) {
  auto r = start();
  const int K = num_servers();
  for (int j = 0; j < K; ++j) {
    size_t b = part_begin(static_cast<size_t>(total), K, j), n = part_size(static_cast<size_t>(total), K, j);
    if (n == 0) continue;
    if (direct(j)) {  // the server writes the shard into out
      send_direct(*r, j, kPullLocal, kPullShared, key, total, n, out + b, nullptr);
      continue;
    }
    send_pull(*r, servers_[j], key, total, out + b, n);
  }
  return r;
}

// Receives are posted before the request goes out, so the reply never waits for a buffer.
void Client::send_pull(Request& r, int server, int64_t key, int64_t total, float* out, size_t n) {
  expect_reply(r, server);
  r.requests_.emplace_back();
  PYCOMM_MPI_CHECK(MPI_Irecv(out, checked_count(n), MPI_BYTE, server, r.tag_, comm_, &r.requests_.back()));
  send_header(r, server, kPull, key, total, static_cast<int64_t>(n), 0);
}

std::unique_ptr<Request> Client::push_pull(int64_t key, int64_t total, const float* grad, float* out) {
  auto r = start();
  const int K = num_servers();
  for (int j = 0; j < K; ++j) {
    size_t b = part_begin(static_cast<size_t>(total), K, j), n = part_size(static_cast<size_t>(total), K, j);
    if (n == 0) continue;
    if (direct(j)) {
      send_direct(*r, j, kPushPullLocal, kPushPullShared, key, total, n, grad + b, out + b);
      continue;
    }
    // One worker's requests are served in order: the pull reads the shard after this push.
    send_header(*r, servers_[j], kPush, key, total, static_cast<int64_t>(n), 0);
    send_chunks(*r, servers_[j], grad + b, n);
    send_pull(*r, servers_[j], key, total, out + b, n);
  }
  return r;
}

std::unique_ptr<Request> Client::simple(int64_t op, int64_t arg, bool reply) {
  auto r = start();
  for (int s : servers_) {
    if (reply) expect_reply(*r, s);
    send_header(*r, s, op, 0, 0, 0, arg);
  }
  return r;
}

std::unique_ptr<Request> Client::clock(int64_t c) { return simple(kClock, c, true); }
std::unique_ptr<Request> Client::clock_pull(int64_t c, const std::vector<int64_t>& totals,
                                            const std::vector<float*>& outs) {
  auto r = start();
  const int K = num_servers();
  r->requests_.reserve(3 * servers_.size() + totals.size() * servers_.size());
  for (int j = 0; j < K; ++j) {
    expect_reply(*r, servers_[j]);
    int64_t shards = 0;
    for (size_t i = 0; i < totals.size(); ++i) {
      size_t b = part_begin(static_cast<size_t>(totals[i]), K, j), n = part_size(static_cast<size_t>(totals[i]), K, j);
      if (n == 0) continue;
      ++shards;
      r->requests_.emplace_back();
      PYCOMM_MPI_CHECK(MPI_Irecv(outs[i] + b, checked_count(n), MPI_BYTE, servers_[j], r->tag_, comm_,
                                 &r->requests_.back()));
    }
    r->expect_shards_.push_back(shards);
    send_header(*r, servers_[j], kClockPull, 0, 0, 0, c);
  }
  return r;
}

std::unique_ptr<Request> Client::flush() { return simple(kFlush, 0, true); }
std::unique_ptr<Request> Client::done() { return simple(kDone, 0, false); }

std::unique_ptr<Request> Client::stats() {
  auto r = simple(kStats, 0, true);
  r->two_phase_ = true;
  return r;
}

std::unique_ptr<Request> Client::save(int server_index) {
  auto r = start();
  int s = servers_.at(static_cast<size_t>(server_index));
  expect_reply(*r, s);
  send_header(*r, s, kSave, 0, 0, 0, 0);
  r->two_phase_ = true;
  return r;
}

std::unique_ptr<Request> Client::load(int server_index, const std::vector<char>& blob) {
  auto r = start();
  int s = servers_.at(static_cast<size_t>(server_index));
  r->payloads_.push_back(blob);  // kept alive until the send completes
  expect_reply(*r, s);
  send_header(*r, s, kLoad, 0, 0, 0, static_cast<int64_t>(blob.size()));
  r->requests_.emplace_back();
  if (blob.size() > static_cast<size_t>(INT32_MAX)) throw comm::CommError("pycomm.ps: server state above 2 GiB");
  PYCOMM_MPI_CHECK(MPI_Isend(r->payloads_.back().data(), static_cast<int>(blob.size()), MPI_BYTE, s, kTagData, comm_,
                             &r->requests_.back()));
  return r;
}

}  // namespace ps
}  // namespace pycomm
