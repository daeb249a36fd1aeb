#include <algorithm>
#include <memory>
#include <vector>

#include "../kernels/reduce.h"
#include "algorithms.h"
#include "stage_clock.h"
#include "timeline.h"
#include "wait_policy.h"

namespace pycomm {
namespace comm {
namespace {

constexpr int kRingTag = 0x5259;  // all ring messages share one tag: order alone matches them
constexpr int kRecvWindow = 4;    // receives kept posted ahead of processing

// One pass over the ring. Step t in [0, 2(N-1)): steps below N-1 form the
// reduce-scatter, the rest the allgather. At step t rank r sends segment
// (r - t) mod N and receives segment (r - t - 1) mod N, so what it receives
// (and reduces) at step t is exactly what it sends at step t+1. Chunks are
// posted and processed in (step, chunk) order on every rank, which lets one
// tag suffice (MPI does not reorder messages between a pair on one tag).
//
// `segments` (reduce-scatter only): the N+1 element offsets of the segments;
// the pass then stops after the reduce-scatter steps, with segment indices
// shifted by one so that rank r ends holding the reduced segment r.
class RingPass {
 public:
  RingPass(const Buffer& buf, ReduceOp op, MPI_Comm comm, size_t chunk_bytes, MemoryMover* memory,
           const std::vector<size_t>* segments = nullptr)
      : buf_(buf), op_(op), comm_(comm), memory_(memory) {
    PYCOMM_MPI_CHECK(MPI_Comm_rank(comm, &rank_));
    PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size_));
    esize_ = kernels::dtype_size(buf.dtype);
    chunk_elems_ = std::max<size_t>(1, chunk_bytes / esize_);
    scatter_only_ = segments != nullptr;
    if (segments) seg_begin_ = *segments;
    else
      for (int j = 0; j <= size_; ++j) seg_begin_.push_back(part_begin(buf.count, size_, j));
    // Chunk table: for segment j, chunks [first_chunk_[j], first_chunk_[j+1]).
    first_chunk_.resize(static_cast<size_t>(size_) + 1, 0);
    for (int j = 0; j < size_; ++j)
      first_chunk_[j + 1] = first_chunk_[j] + (seg_begin_[j + 1] - seg_begin_[j] + chunk_elems_ - 1) / chunk_elems_;
    send_req_.assign(first_chunk_.back(), MPI_REQUEST_NULL);
    dtype_ = MPI_BYTE;
  }

  void run() {
    const int steps = scatter_only_ ? size_ - 1 : 2 * (size_ - 1);
    left_ = (rank_ - 1 + size_) % size_;
    right_ = (rank_ + 1) % size_;
    // A slot holds the largest chunk this pass receives: a small message needs no chunk-sized slots.
    // (Zero-filled kRecvWindow chunks of 512 KiB on every pass took longer than a 64 KiB allreduce.)
    size_t largest_segment = 0;
    for (int j = 0; j < size_; ++j) largest_segment = std::max(largest_segment, seg_begin_[j + 1] - seg_begin_[j]);
    slot_elems_ = std::min(chunk_elems_, largest_segment);
    const size_t slot_bytes = static_cast<size_t>(kRecvWindow) * slot_elems_ * esize_;
    if (memory_) {
      device_lease_ = std::make_unique<MemoryMover::Lease>(memory_->working_memory(slot_bytes));
      device_slots_ = static_cast<char*>(device_lease_->get());
    } else {
      host_slots_.reset(new char[slot_bytes]);  // not zero-filled: every byte is received before it is read
    }

    // Step 0 sends come straight from the caller's data.
    stage_clock::StageClock clock;  // MPI's bytes: those sent and received
    for (size_t c = 0; c < chunks_of(send_seg(0)); ++c) post_send(0, c);
    clock.mark(stage_clock::kMpi, (seg_begin_[send_seg(0) + 1] - seg_begin_[send_seg(0)]) * esize_);

    // Receives in (step, chunk) order, kRecvWindow ahead.
    std::vector<std::pair<int, size_t>> order;
    for (int t = 0; t < steps; ++t)
      for (size_t c = 0; c < chunks_of(recv_seg(t)); ++c) order.emplace_back(t, c);
    std::vector<MPI_Request> recv_req(order.size(), MPI_REQUEST_NULL);
    size_t posted = 0;
    timeline::Phase phase("REDUCE_SCATTER");  // steps below N-1; then the allgather
    for (size_t i = 0; i < order.size(); ++i) {
      if (order[i].first == size_ - 1 && (i == 0 || order[i - 1].first < size_ - 1)) phase.next("ALLGATHER");
      while (posted < order.size() && posted < i + kRecvWindow) {
        post_recv(order[posted].first, order[posted].second, posted % kRecvWindow, &recv_req[posted]);
        ++posted;
      }
      wait_request(&recv_req[i]);  // waits give up the core under contention (wait_policy.h)
      const int t = order[i].first;
      const size_t c = order[i].second;
      size_t begin, len;
      chunk_range(recv_seg(t), c, &begin, &len);
      clock.mark(stage_clock::kMpi, len * esize_);
      if (t < size_ - 1) {
        if (memory_) memory_->reduce(buf_.bytes_at(begin), slot(i % kRecvWindow), len, buf_.dtype, op_);
        else kernels::reduce_cpu(buf_.bytes_at(begin), slot(i % kRecvWindow), len, buf_.dtype, op_);
        clock.mark(stage_clock::kReduce, stage_clock::reduction_bytes(len * esize_));
      }
      if (t + 1 < steps) {
        post_send(t + 1, c);
        clock.mark(stage_clock::kMpi, len * esize_);
      }
    }
    wait_requests(static_cast<int>(send_req_.size()), send_req_.data());
    clock.mark(stage_clock::kMpi);
  }

 private:
  int send_seg(int t) const { return ((rank_ - t - shift()) % size_ + size_) % size_; }
  int recv_seg(int t) const { return ((rank_ - t - 1 - shift()) % size_ + size_) % size_; }
  int shift() const { return scatter_only_ ? 1 : 0; }
  size_t chunks_of(int seg) const { return first_chunk_[seg + 1] - first_chunk_[seg]; }
  char* slot(size_t s) { return (memory_ ? device_slots_ : host_slots_.get()) + s * slot_elems_ * esize_; }

  void chunk_range(int seg, size_t c, size_t* begin, size_t* len) const {
    size_t seg_begin = seg_begin_[seg], seg_len = seg_begin_[seg + 1] - seg_begin_[seg];
    *begin = seg_begin + c * chunk_elems_;
    *len = std::min(chunk_elems_, seg_len - c * chunk_elems_);
  }

  static int checked_int(size_t bytes) {
    if (bytes > static_cast<size_t>(INT32_MAX)) throw CommError("ring_allreduce: chunk larger than 2 GiB");
    return static_cast<int>(bytes);
  }

  void post_send(int t, size_t c) {
    int seg = send_seg(t);
    size_t begin, len;
    chunk_range(seg, c, &begin, &len);
    MPI_Request& req = send_req_[first_chunk_[seg] + c];
    wait_request(&req);
    PYCOMM_MPI_CHECK(MPI_Isend(buf_.bytes_at(begin), checked_int(len * esize_), dtype_, right_, kRingTag, comm_, &req));
  }

  void post_recv(int t, size_t c, size_t slot_index, MPI_Request* req) {
    int seg = recv_seg(t);
    size_t begin, len;
    chunk_range(seg, c, &begin, &len);
    void* dst;
    if (t < size_ - 1) {
      dst = slot(slot_index);  // reduce-scatter: into scratch, reduced when processed
    } else {
      // allgather: straight into place, once the earlier send from there is done
      MPI_Request& pending = send_req_[first_chunk_[seg] + c];
      wait_request(&pending);
      dst = buf_.bytes_at(begin);
    }
    PYCOMM_MPI_CHECK(MPI_Irecv(dst, checked_int(len * esize_), dtype_, left_, kRingTag, comm_, req));
  }

  const Buffer& buf_;
  ReduceOp op_;
  MPI_Comm comm_;
  MPI_Datatype dtype_;
  int rank_ = 0, size_ = 1, left_ = 0, right_ = 0;
  size_t esize_ = 4, chunk_elems_ = 1, slot_elems_ = 1;
  std::vector<size_t> first_chunk_;
  std::vector<size_t> seg_begin_;
  bool scatter_only_ = false;
  std::vector<MPI_Request> send_req_;
  MemoryMover* memory_;
  std::unique_ptr<char[]> host_slots_;
  std::unique_ptr<MemoryMover::Lease> device_lease_;  // the mover's cached working memory
  char* device_slots_ = nullptr;
};

}  // namespace

void ring_allreduce(const Buffer& buf, ReduceOp op, MPI_Comm comm, size_t chunk_bytes, MemoryMover* memory) {
  int size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size));
  if (size == 1 || buf.count == 0) return;
  if (buf.device != Device::CPU && !memory) throw CommError("ring_allreduce: device memory needs its MemoryMover");
  RingPass(buf, op, comm, chunk_bytes, memory).run();
}

void ring_reduce_scatter_inplace(const Buffer& buf, const std::vector<size_t>& segments, ReduceOp op, MPI_Comm comm,
                                 size_t chunk_bytes, MemoryMover* memory) {
  int size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size));
  if (segments.size() != static_cast<size_t>(size) + 1 || segments.back() != buf.count)
    throw CommError("ring_reduce_scatter: segment table does not match the communicator or the buffer");
  if (size == 1 || buf.count == 0) return;
  RingPass(buf, op, comm, chunk_bytes, memory, &segments).run();
}

}  // namespace comm
}  // namespace pycomm
