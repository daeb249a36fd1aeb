// pycomm.join(): uneven inputs. A rank that has run out of work joins; until
// every rank has joined, it takes part in what the others still run, so they
// neither hang nor need to know who stopped early:
//   allreduce   it contributes the reduction's identity (0 for sum and avg,
//               +inf/-inf or the integer limits for min/max, 1 for prod), and
//               an average divides by the ranks that contributed, N - joined;
//   fused batch the same, tensor by tensor, through the same fused path;
//   broadcast   it receives and discards (from a root that has not joined);
//   allgather   it contributes no rows;
//   barrier     it enters the barrier.
// Horovod's join (answer_gathers=false) refuses allgathers and broadcasts
// instead: the ranks that called them get CommError and the joined ranks stay.
// Anything else raises CommError on every rank (coordinator_join in
// coordinator.cpp decides). Each round is one coordination round in which the
// joined ranks propose JOIN and are sent the others' batch; the data movement
// is then exactly the others' (same algorithm, sizes and fusion), so every
// algorithm works unchanged.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>

#include "../kernels/reduce.h"
#include "algorithms.h"
#include "engine.h"
#include "timeline.h"

namespace pycomm {
namespace comm {
namespace {

template <class T>
void fill_with(void* p, size_t n, T v) {
  std::fill_n(static_cast<T*>(p), n, v);
}

// The identity element of `op` for `dtype`: what a joined rank contributes.
void fill_identity(void* p, size_t n, DType dtype, ReduceOp op) {
  if (n == 0) return;
  if (op == ReduceOp::SUM) {
    std::memset(p, 0, n * kernels::dtype_size(dtype));
    return;
  }
  const bool mn = op == ReduceOp::MIN, mx = op == ReduceOp::MAX;
  switch (dtype) {
    case DType::F32: {
      constexpr float inf = std::numeric_limits<float>::infinity();
      return fill_with<float>(p, n, mn ? inf : mx ? -inf : 1.0f);
    }
    case DType::F64: {
      constexpr double inf = std::numeric_limits<double>::infinity();
      return fill_with<double>(p, n, mn ? inf : mx ? -inf : 1.0);
    }
    case DType::F16: return fill_with<uint16_t>(p, n, mn ? 0x7C00 : mx ? 0xFC00 : 0x3C00);  // +inf, -inf, 1
    case DType::BF16: return fill_with<uint16_t>(p, n, mn ? 0x7F80 : mx ? 0xFF80 : 0x3F80);
    case DType::I32:
      return fill_with<int32_t>(p, n, mn ? std::numeric_limits<int32_t>::max()
                                         : mx ? std::numeric_limits<int32_t>::min() : 1);
    case DType::I64:
      return fill_with<int64_t>(p, n, mn ? std::numeric_limits<int64_t>::max()
                                         : mx ? std::numeric_limits<int64_t>::min() : 1);
    case DType::U8: return fill_with<uint8_t>(p, n, mn ? 0xFF : mx ? 0 : 1);
    case DType::I8:
      return fill_with<int8_t>(p, n, mn ? std::numeric_limits<int8_t>::max()
                                        : mx ? std::numeric_limits<int8_t>::min() : 1);
    case DType::I16:
      return fill_with<int16_t>(p, n, mn ? std::numeric_limits<int16_t>::max()
                                         : mx ? std::numeric_limits<int16_t>::min() : 1);
    case DType::BOOL: return fill_with<uint8_t>(p, n, mx ? 0 : 1);  // or: false; and (min, prod): true
  }
}

}  // namespace

WorkPtr Engine::join(std::shared_ptr<int> last_rank, bool blocking, bool answer_gathers) {
  Signature sig;
  sig.kind = static_cast<int32_t>(Collective::JOIN);
  sig.extra = answer_gathers ? 0 : 1;  // coordinator.cpp: refuse the others' allgathers and broadcasts
  return submit_custom(sig, "join", "", nullptr, [this, last_rank] { *last_rank = join_last_; }, blocking);
}

size_t Engine::execute_join(std::vector<Op*>& batch) {
  Op* op = batch.front();
  std::exception_ptr error;
  uint64_t answered = 0;
  const std::vector<Signature> proposal{op->sig};
  std::vector<timeline::Clock::time_point> submitted;
  if (timeline::on()) submitted.push_back(op->submitted);
  timeline::Batch tl(proposal, submitted);
  tl.decided(1);
  try {
    // One round per batch the others run; the same stall limits as any round.
    for (;;) {
      timeline::Phase phase("NEGOTIATE");
      coordinator_.agree(proposal, "pycomm.join", active_.stall, active_.check_consistency);
      if (coordinator_.resolution().kind == Resolution::RETRY) {
        // Nothing for this rank this round: the others' call was refused (Horovod's join), or a
        // rank holds only named operations aside (pair_by_name) and proposes again shortly.
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      const JoinInfo& info = coordinator_.join_info();
      if (info.done) {
        join_last_ = info.last_rank;
        break;
      }
      phase.next("ANSWER");
      exec_->set_joined(std::max(info.joined, 1));  // this rank has: the others take no peer path either
      answer_joined(info.ops);
      answered += info.ops.size();
    }
    op->body();
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.operations += 1;
    last_op_ = "join (answered " + std::to_string(answered) + " operations of other ranks)";
    idle_since_ = std::chrono::steady_clock::now();
  }
  op->work->finish(error);
  return 1;
}

void Engine::answer_joined(const std::vector<Signature>& sigs) {
  if (sigs.empty()) throw CommError("pycomm internal error: empty join round");
  const Signature& s = sigs.front();
  const DType dtype = static_cast<DType>(s.dtype);
  const size_t esize = kernels::dtype_size(dtype);
  switch (static_cast<Collective>(s.kind)) {
    case Collective::ALLREDUCE: {
      // The others' batch, with identity-filled buffers of the same sizes, on the same path.
      size_t total = 0;
      for (const Signature& x : sigs) total += static_cast<size_t>(x.numel) * kernels::dtype_size(static_cast<DType>(x.dtype));
      join_scratch_.resize(std::max<size_t>(total, 1));
      std::vector<Op> ops(sigs.size());
      std::vector<Op*> ptrs;
      size_t offset = 0;
      for (size_t i = 0; i < sigs.size(); ++i) {
        const Signature& x = sigs[i];
        Buffer b;
        b.data = join_scratch_.data() + offset;
        b.count = static_cast<size_t>(x.numel);
        b.dtype = static_cast<DType>(x.dtype);
        offset += b.bytes();
        fill_identity(b.data, b.count, b.dtype, static_cast<ReduceOp>(x.op));
        AllreduceArgs& a = ops[i].allreduce;
        a.input = a.output = b;
        a.op = static_cast<ReduceOp>(x.op);
        a.average = false;  // the others' averages divide by the contributors themselves (run_with_joined)
        a.algorithm = static_cast<Algorithm>(x.algorithm);
        ops[i].fusable = true;
        ops[i].sig = x;
        ptrs.push_back(&ops[i]);
      }
      if (ptrs.size() == 1) exec_->allreduce(ops.front().allreduce);
      else run_fused(ptrs, ptrs.size());
      return;
    }
    case Collective::BROADCAST: {
      Buffer b;
      b.count = static_cast<size_t>(s.numel);
      b.dtype = dtype;
      join_scratch_.resize(std::max<size_t>(b.bytes(), 1));
      b.data = join_scratch_.data();
      if (topo_.size <= 1 || b.count == 0) return;
      // The same MPI messages as the others' path: staged broadcasts go in staging chunks.
      if (exec_->path_of(static_cast<Device>(s.device)) == MemoryPath::STAGED) {
        const size_t chunk = exec_->staged_broadcast_chunk();
        for (size_t off = 0; off < b.bytes(); off += chunk)
          PYCOMM_MPI_CHECK(MPI_Bcast(join_scratch_.data() + off, static_cast<int>(std::min(chunk, b.bytes() - off)),
                                     MPI_BYTE, s.root, topo_.world));
      } else {
        comm::broadcast(b, s.root, topo_.world);
      }
      return;
    }
    case Collective::ALLGATHER: {
      size_t row_elems = 1;
      for (int d = 1; d < s.ndim && d < Signature::kMaxDims; ++d) row_elems *= static_cast<size_t>(s.dims[d]);
      const char none = 0;
      allgatherv(&none, 0, row_elems * esize, topo_.world, [this, row_elems, esize](size_t rows) -> void* {
        join_scratch_.resize(std::max<size_t>(rows * row_elems * esize, 1));
        return join_scratch_.data();
      });
      return;
    }
    case Collective::BARRIER:
      PYCOMM_MPI_CHECK(MPI_Barrier(topo_.world));
      return;
    default:
      throw CommError("pycomm.join: a joined rank cannot answer " + s.describe());
  }
}

void Engine::run_with_joined(std::vector<Op*>& batch, size_t count, int joined) {
  // Averages divide by the ranks that contributed, k = N - joined: sums are
  // scaled by 1/k afterwards, fp16/bf16 inputs before (their sum may overflow).
  const double inv_k = 1.0 / static_cast<double>(topo_.size - joined);
  std::vector<Op> ops;
  ops.reserve(count);
  std::vector<Buffer> post;
  for (size_t i = 0; i < count; ++i) {
    Op* op = batch[i];
    // broadcast, allgather, barrier: a joined rank takes part as usual (count is 1). Device
    // allreduces run alone: the scaling below works on host memory.
    if (!op->fusable || op->allreduce.output.device != Device::CPU) {
      op->body();
      continue;
    }
    AllreduceArgs a = op->allreduce;
    if (a.average) {
      a.average = false;
      if (a.output.dtype == DType::F16 || a.output.dtype == DType::BF16) {
        if (a.output.data != a.input.data && a.input.count) std::memcpy(a.output.data, a.input.data, a.input.bytes());
        kernels::scale_cpu(a.output.data, a.output.count, a.output.dtype, inv_k);
        a.input = a.output;
      } else {
        post.push_back(a.output);
      }
    }
    ops.push_back(*op);
    ops.back().allreduce = a;
  }
  if (ops.size() == 1) {
    exec_->allreduce(ops.front().allreduce);
  } else if (ops.size() > 1) {
    std::vector<Op*> ptrs;
    for (Op& o : ops) ptrs.push_back(&o);
    run_fused(ptrs, ptrs.size());
  }
  for (const Buffer& b : post) kernels::scale_cpu(b.data, b.count, b.dtype, inv_k);
}

}  // namespace comm
}  // namespace pycomm
