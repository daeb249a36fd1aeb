// One parameter-server shard holder. A server owns, for every tensor, the
// contiguous element range part_begin(n, K, j) .. + part_size(n, K, j) of the
// flattened tensor (server j of K): equal byte ranges of every tensor, so the
// load is balanced whatever the tensor sizes are. It serves the protocol of
// protocol.h in one loop (a thread of a worker rank when co-located, the main
// thread of a dedicated server rank), applies the update rule of
// kernels/ps_update.h to its shard as pushes arrive, keeps per worker the
// version it last pulled (staleness = updates since then, histogrammed), the
// copy of the weights it last pulled (DC-ASGD), and SSP clocks.
// The loop ends when every worker has sent kDone: every request sent before
// that has been served.
#pragma once
#include <mpi.h>

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../kernels/ps_update.h"
#include "protocol.h"

namespace pycomm {
namespace ps {

struct ServerConfig {
  kernels::PsUpdate update;      // alpha is the step when adadelay is off
  bool adadelay = false;         // alpha = 1 / (L + c sqrt(t + tau))
  double adadelay_L = 1.0;
  double adadelay_c = 0.0;
  int64_t staleness_bound = -1;  // SSP's s; < 0: clock requests are answered at once
  double stall_report_s = 60.0;  // name a worker silent this long while others wait (0: never)
  // Process id of every worker on this server's host (0: on another host). The loop
  // looks at them every liveness_check_s and names a worker whose process is gone.
  std::vector<int> worker_pids;
  double liveness_check_s = 0.01;  // a few /proc reads per 10 ms; well inside the launcher's teardown
};

// Reads `bytes` at `address` in process `pid` of this host into out (process_vm_readv):
// 0, or the errno. The ParameterServer probes with it whether a server may reach a worker's memory.
int memory_probe(int pid, int64_t address, void* out, size_t bytes);

class Server {
 public:
  // comm: the parameter-server communicator; workers: their ranks in it (worker i = workers[i]).
  Server(MPI_Comm comm, std::vector<int> workers, ServerConfig config);

  // Serve until every worker has sent kDone. Thread-safe against stop_requested() only.
  void run();

 private:
  struct Shard {
    int64_t total = 0;
    size_t count = 0;
    bool initialized = false;
    uint64_t version = 0;  // updates applied
    std::vector<float> w, v, ms;
    std::vector<uint64_t> pulled_version;      // per worker, at its last pull
    std::vector<std::vector<float>> backup;    // per worker, w at its last pull (DC-ASGD)
    int sending = 0;                           // replies MPI still reads from w (zero-copy)
  };
  // A reply in flight: its header words, a copy (stats, save), or w itself. A shard
  // whose w must change while MPI still reads it hands that buffer to its replies
  // (keep) and continues on a copy (prepare_write).
  struct Outgoing {
    std::array<int64_t, kReplyWords> words{};
    std::vector<char> bytes;
    Shard* from = nullptr;
    std::shared_ptr<std::vector<float>> keep;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  // Where the server's time goes (PYCOMM_PS_PROFILE=1 prints it when the loop ends).
  struct Profile {
    double recv_s = 0;     // posting and waiting for push/init chunks
    double update_s = 0;   // the update kernel
    double copy_s = 0;     // local pulls, DC-ASGD backups, copy-on-write of busy shards, reply copies
    double sleep_s = 0;    // back-off sleeps of the idle loop
    double reap_s = 0;     // testing replies in flight
    uint64_t requests = 0, chunks = 0, cow = 0;
  };

  void serve(const int64_t* h, int source);
  void report_memory_error(const char* what, int worker, const int64_t* h, int err, size_t applied = 0);
  void handle_data(const int64_t* h, int source, int worker);
  void reply(int dest, int tag, int64_t status, int64_t value, const void* data, size_t bytes, bool send_data);
  void send_copy(int dest, int tag, const void* data, size_t bytes);
  void send_shard(int dest, int tag, Shard& s);
  void prepare_write(Shard& s);
  void apply_push(Shard& s, int worker, const float* g, size_t begin, size_t n, const kernels::PsUpdate& u);
  kernels::PsUpdate begin_push(Shard& s, int worker);
  void print_profile() const;
  void backup(Shard& s, int worker);
  void recv_push_chunks(size_t count, int source, const std::function<void(const float*, size_t, size_t)>& on_chunk);
  void recv_chunks(float* dst, size_t count, int source, const std::function<void(size_t, size_t)>& on_chunk);
  void pull_all(int dest, int tag, int worker);
  void answer_clocks();
  void reap_sends(bool all);
  void report_stalls();
  void check_liveness();
  Shard& shard_for(int64_t key, int64_t total, size_t count, int worker, const char* what);
  std::vector<char> save() const;
  bool load(const std::vector<char>& blob, std::string* error);
  bool uses_backup() const { return config_.update.comp != kernels::PsCompensation::None; }

  MPI_Comm comm_;
  int rank_ = 0, nworkers_ = 0;
  std::vector<int> workers_;
  std::vector<int> worker_of_rank_;
  ServerConfig config_;
  std::map<int64_t, Shard> shards_;
  std::vector<int64_t> clocks_;
  std::vector<char> done_;
  int done_count_ = 0;
  struct ClockWait { int rank; int tag; int64_t clock; bool pull; int worker; };
  std::vector<ClockWait> clock_waits_;
  // Staleness per worker: histogram, pushes, sum, max.
  std::vector<std::array<uint64_t, kHistogramBins>> hist_;
  std::vector<uint64_t> pushes_, staleness_sum_, staleness_max_;
  std::vector<std::chrono::steady_clock::time_point> last_seen_;
  std::vector<char> reported_;
  std::string died_;  // "worker i (rank r, pid p)" of each worker found dead; run() raises if any
  std::list<Outgoing> outgoing_;
  std::vector<float> scratch_;
  std::vector<float> bounce_;  // a gradient block read from a worker of this host (kCacheBlockFloats)
  std::vector<MPI_Request> chunk_requests_;
  Profile prof_;
  bool profile_ = false;
};

}  // namespace ps
}  // namespace pycomm
