// pycomm as a torch.distributed backend: a c10d::Backend subclass whose
// collectives are submitted to pycomm's engine (the world's, or a process
// group's own), with no Python on the per-op path. Every collective goes
// through the engine's coordination round (agreement check, fusion of
// allreduces, stall watchdog); send/recv go straight to MPI on a communicator
// of their own. Work objects complete their futures on the engine thread.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <mpi.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "../bindings/error_feedback.h"
#include "call_sites.h"

namespace pycomm {
namespace c10d_backend {

class ProcessGroupPycomm : public c10d::Backend {
 public:
  // `group`: the pycomm engine that runs the collectives (0: the world);
  // `p2p`: a communicator over the same ranks, for send/recv only;
  // `compression`: PYCOMM_COMPRESSION for the float32 SUM/AVG allreduces:
  // "" or "none" (exact), "fp16", "bf16" or "onebit".
  ProcessGroupPycomm(int rank, int size, int64_t group, MPI_Comm p2p, const std::string& compression = "");

  const std::string getBackendName() const override { return "pycomm"; }
  int64_t group_id() const { return group_; }

  // Compression ("none", "fp16", "bf16", "onebit") and, for onebit, the
  // error-feedback state (call_sites.h): one residual pair per call site, in
  // the store pycomm.compression.OneBit uses too (bindings/error_feedback.h),
  // tagged with the site's key.
  std::string compression() const;
  // A site: (position in the fixed period, or -1 while learning; the key's hash).
  using Site = std::pair<int64_t, uint64_t>;
  using Residuals = bindings::OnebitResiduals<Site, SiteKey>;
  struct CompressionState {
    size_t period = 0;  // 0 while learning
    uint64_t breaks = 0;
    Site last{-1, 0};   // the site of the latest onebit call
    std::map<Site, Residuals::Pair> residuals;  // the live tensors, tagged with their keys
  };
  CompressionState compression_state();
  void reset_compression();

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // Several tensors in one engine operation: flattened into one buffer (same dtype and device),
  // reduced or gathered once, copied back (docs/compatibility.md).
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  // gloo's monitored barrier: rank 0 waits up to opts.timeout for every rank and names the ranks
  // that did not arrive (the first one; all of them with waitAllRanks). torch's
  // dist.monitored_barrier() accepts gloo only; call it as
  // group._get_backend(torch.device("cpu")).monitored_barrier(timeout, wait_all_ranks).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  // The group's collective count, the same on every rank (starts at 0 when the group is made).
  void setSequenceNumberForGroup() override { seq_ = 0; }
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  c10::intrusive_ptr<c10d::Work> compressed_allreduce(const at::Tensor& t, bool average, bool blocking);
  c10::intrusive_ptr<c10d::Work> sparse_allreduce(at::Tensor& t, const c10d::AllreduceOptions& opts);

  int64_t group_;
  MPI_Comm p2p_;
  int compression_ = 0;  // comm::Compression, 0 = none
  std::atomic<bool> warned_{false};  // the one "sent uncompressed" warning
  std::atomic<uint64_t> seq_{0};      // collectives submitted on this group (getSequenceNumberForGroup)
  std::mutex sites_mu_;  // callers may submit from several threads (DDP's autograd threads)
  CallSites sites_;
  Residuals residuals_;
  Site last_{-1, 0};
};

}  // namespace c10d_backend
}  // namespace pycomm
