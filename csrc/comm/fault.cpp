#include "fault.h"

#if __has_include(<mpi-ext.h>)  // Open MPI's extensions (ULFM among them); MPICH has no such header
#include <mpi-ext.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

namespace pycomm {
namespace comm {
namespace fault {
namespace {

#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
constexpr bool kUlfmBuilt = true;
#else
constexpr bool kUlfmBuilt = false;
#endif

// How often a spin-wait asks MPI for failed processes: well inside the 2 s a survivor may take to
// notice a death (docs/elastic.md), and rare enough to cost nothing measurable.
constexpr auto kPollInterval = std::chrono::milliseconds(20);
// A survivor told of a failure by a revoked communicator may not yet know which process died; how
// long it waits for MPI to name it.
constexpr auto kNameWait = std::chrono::milliseconds(1000);

std::mutex g_mu;
bool g_enabled = false;
std::atomic<bool> g_enabled_flag{false};
MPI_Comm g_world = MPI_COMM_NULL;
std::vector<MPI_Comm> g_watched;
std::shared_ptr<RanksFailedError> g_failure;
std::atomic<bool> g_failed{false};
std::atomic<int64_t> g_next_poll_ns{0};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// World ranks of the processes MPI knows to have failed (with g_mu held).
std::vector<int> failed_world_ranks() {
  std::vector<int> ranks;
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
  MPI_Group failed = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  if (MPIX_Comm_get_failed(g_world, &failed) != MPI_SUCCESS) return ranks;
  int n = 0;
  MPI_Group_size(failed, &n);
  if (n > 0 && MPI_Comm_group(g_world, &world_group) == MPI_SUCCESS) {
    std::vector<int> in(static_cast<size_t>(n)), out(static_cast<size_t>(n), MPI_UNDEFINED);
    for (int i = 0; i < n; ++i) in[static_cast<size_t>(i)] = i;
    MPI_Group_translate_ranks(failed, n, in.data(), world_group, out.data());
    for (int r : out)
      if (r != MPI_UNDEFINED) ranks.push_back(r);
    MPI_Group_free(&world_group);
  }
  MPI_Group_free(&failed);
  std::sort(ranks.begin(), ranks.end());
#endif
  return ranks;
}

// MPI learns of a death in its progress engine, which runs only inside MPI calls; a wait on shared
// memory makes none. A probe on COMM_SELF (it matches nothing) drives it.
void drive_progress() {
  int flag = 0;
  MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_SELF, &flag, MPI_STATUS_IGNORE);
}

std::string error_string(int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) len = 0;
  return std::string(msg, static_cast<size_t>(len));
}

}  // namespace

std::string ulfm_unavailable() {
  if (!kUlfmBuilt)
    return "this MPI has no fault-tolerance extension (ULFM: MPIX_Comm_revoke, MPIX_Comm_shrink); elastic mode "
           "needs Open MPI 5 or later";
  // Built with ULFM; is it switched on in this process? Open MPI's MCA parameter mpi_ft_enable.
  int provided = 0;
  if (MPI_T_init_thread(MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
    return "cannot read MPI's control variables (MPI_T_init_thread failed) to see whether fault tolerance is on";
  std::string why;
  int index = -1;
  if (MPI_T_cvar_get_index("mpi_ft_enable", &index) != MPI_SUCCESS) {
    why = "this MPI has no control variable mpi_ft_enable, so it cannot say whether fault tolerance is on";
  } else {
    MPI_T_cvar_handle handle;
    int count = 0;
    int64_t value = 0;  // a bool or int parameter: any non-zero byte means on
    if (MPI_T_cvar_handle_alloc(index, nullptr, &handle, &count) != MPI_SUCCESS) {
      why = "cannot read MPI's control variable mpi_ft_enable";
    } else {
      if (MPI_T_cvar_read(handle, &value) != MPI_SUCCESS) why = "cannot read MPI's control variable mpi_ft_enable";
      MPI_T_cvar_handle_free(&handle);
      if (why.empty() && value == 0)
        why = "MPI's fault tolerance is off in this job (mpi_ft_enable=false): launch with `mpirun --with-ft ulfm` "
              "(pycomm-run --elastic)";
    }
  }
  MPI_T_finalize();
  return why;
}

void enable(MPI_Comm world) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_enabled = true;
  g_world = world;
  g_watched.assign(1, world);
  g_failure.reset();
  g_failed = false;
  g_next_poll_ns = 0;
  g_enabled_flag = true;
}

void disable() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_enabled = false;
  g_enabled_flag = false;
  g_world = MPI_COMM_NULL;
  g_watched.clear();
  g_failure.reset();
  g_failed = false;
}

bool enabled() { return g_enabled_flag.load(std::memory_order_relaxed); }

void watch(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_enabled && std::find(g_watched.begin(), g_watched.end(), comm) == g_watched.end()) g_watched.push_back(comm);
}

void unwatch(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_watched.erase(std::remove(g_watched.begin(), g_watched.end(), comm), g_watched.end());
}

bool is_failure(int rc) {
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
  int cls = rc;
  if (MPI_Error_class(rc, &cls) != MPI_SUCCESS) cls = rc;
  return cls == MPIX_ERR_PROC_FAILED || cls == MPIX_ERR_PROC_FAILED_PENDING || cls == MPIX_ERR_REVOKED;
#else
  (void)rc;
  return false;
#endif
}

void raise(int rc, const char* call) {
  std::shared_ptr<RanksFailedError> failure;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_failure) {
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
      // Interrupt every survivor still blocked on a live peer: their calls on these fail with MPI_ERR_REVOKED.
      for (MPI_Comm c : g_watched) MPIX_Comm_revoke(c);
#endif
      std::vector<int> ranks = failed_world_ranks();
      const auto give_up = std::chrono::steady_clock::now() + kNameWait;
      while (ranks.empty() && std::chrono::steady_clock::now() < give_up) {
        drive_progress();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ranks = failed_world_ranks();
      }
      std::ostringstream msg;
      if (ranks.empty()) {
        msg << "pycomm: a rank of the job has failed (MPI has not named it within "
            << std::chrono::duration_cast<std::chrono::milliseconds>(kNameWait).count() << " ms)";
      } else {
        msg << "pycomm: " << (ranks.size() == 1 ? "rank " : "ranks ");
        for (size_t i = 0; i < ranks.size(); ++i) msg << (i ? "," : "") << ranks[i];
        msg << (ranks.size() == 1 ? " has" : " have") << " failed";
      }
      msg << " (" << call << " -> " << error_string(rc)
          << "). pycomm's communicators are revoked; pycomm.elastic.run recovers on the survivors.";
      g_failure = std::make_shared<RanksFailedError>(msg.str(), std::move(ranks));
      g_failed = true;
    }
    failure = g_failure;
  }
  throw RanksFailedError(*failure);
}

bool failed() { return g_failed.load(std::memory_order_acquire); }

void check() {
  if (!g_failed.load(std::memory_order_acquire)) return;
  std::shared_ptr<RanksFailedError> failure;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    failure = g_failure;
  }
  if (failure) throw RanksFailedError(*failure);
}

void poll() {
  if (!enabled()) return;
  check();
  const int64_t now = now_ns();
  if (now < g_next_poll_ns.load(std::memory_order_relaxed)) return;
  g_next_poll_ns = now + std::chrono::duration_cast<std::chrono::nanoseconds>(kPollInterval).count();
  // Without this, survivors waiting in a shared-window fence for a rank that died inside a fused
  // batch waited for ever in about one run of 20 (tests/test_elastic.py's fused batch): nothing
  // told MPI's progress engine of the death.
  drive_progress();
  bool any = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_enabled) return;
    any = !failed_world_ranks().empty();
  }
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
  if (any) raise(MPIX_ERR_PROC_FAILED, "a wait for other ranks");
#else
  (void)any;
#endif
}

}  // namespace fault
}  // namespace comm
}  // namespace pycomm
