// The worker's side of the parameter server: non-blocking push / pull of one
// tensor to / from every server holding a shard of it, SSP clocks, flush,
// done, and state/statistics requests. Not thread-safe: one caller at a time
// (the Python client serializes). Requests may be in flight together; each
// gets its own reply tag.
#pragma once
#include <mpi.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "protocol.h"

namespace pycomm {
namespace ps {

// One outstanding request to every server concerned; wait() completes it.
class Request {
 public:
  ~Request();
  // Wait for every message; returns the first non-kOk status of the replies (kOk if none).
  int64_t wait();
  bool test();
  // Reply words of server j (valid after wait), for save/stats.
  const std::vector<std::array<int64_t, kReplyWords>>& replies() const { return replies_; }
  std::vector<std::vector<char>>& payloads() { return payloads_; }

 private:
  friend class Client;
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::vector<MPI_Request> requests_;
  std::vector<std::array<int64_t, kHeaderWords>> headers_;
  std::vector<std::array<int64_t, kReplyWords>> replies_;
  std::vector<int> reply_from_;
  std::vector<std::vector<char>> payloads_;
  bool two_phase_ = false;
  std::vector<int64_t> expect_shards_;  // clock_pull: shards each server must send  // save/stats: the payload size comes in the reply
  int tag_ = 0;
  bool done_ = false;
};

class Client {
 public:
  Client(MPI_Comm comm, std::vector<int> servers);

  int num_servers() const { return static_cast<int>(servers_.size()); }
  // Servers (by index) that reach this process's memory directly (same host, probed by the
  // ParameterServer): push, pull and push_pull to them send only a header (protocol.h kPushShared).
  void set_shared(const std::vector<int>& server_indices);
  std::unique_ptr<Request> init(int64_t key, int64_t total, const float* data);
  std::unique_ptr<Request> push(int64_t key, int64_t total, const float* data);
  std::unique_ptr<Request> pull(int64_t key, int64_t total, float* out);
  // push(grad) then pull(out) of the same key as one request: out receives the weights with this
  // push applied (as a push followed by a pull would); the local shard is updated and read in one pass.
  std::unique_ptr<Request> push_pull(int64_t key, int64_t total, const float* grad, float* out);
  std::unique_ptr<Request> clock(int64_t c);
  // Clock c, and receive every tensor (ascending key; all must be initialized on the servers) as the
  // servers read them when the clock is answered. totals[i] elements land at outs[i].
  std::unique_ptr<Request> clock_pull(int64_t c, const std::vector<int64_t>& totals, const std::vector<float*>& outs);
  std::unique_ptr<Request> flush();
  std::unique_ptr<Request> done();
  // Sizes come first; wait() then receives the payloads.
  std::unique_ptr<Request> stats();
  std::unique_ptr<Request> save(int server_index);
  std::unique_ptr<Request> load(int server_index, const std::vector<char>& blob);

 private:
  std::unique_ptr<Request> start();
  int next_tag();
  void send_header(Request& r, int server, int64_t op, int64_t key, int64_t total, int64_t count, int64_t arg,
                   int64_t out = 0, int64_t pid = 0);
  // A request to server index j answered by a header only: in this process, or shared memory.
  bool direct(int j) const { return servers_[static_cast<size_t>(j)] == rank_ || shared_[static_cast<size_t>(j)]; }
  void send_direct(Request& r, int j, int64_t in_process_op, int64_t shared_op, int64_t key, int64_t total, size_t n,
                   const float* arg, const float* out);
  void send_pull(Request& r, int server, int64_t key, int64_t total, float* out, size_t n);
  void expect_reply(Request& r, int server);
  std::unique_ptr<Request> simple(int64_t op, int64_t arg, bool reply);
  void send_chunks(Request& r, int server, const float* data, size_t n);

  MPI_Comm comm_;
  int rank_ = -1;  // this process in comm_: a server of the same rank is its own server thread
  std::vector<int> servers_;
  int tag_counter_ = 0;
  std::vector<char> shared_;  // per server index
  int64_t pid_ = 0;
};

}  // namespace ps
}  // namespace pycomm
