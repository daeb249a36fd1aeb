// The engine's device side: fusion of device tensors in a device fusion
// buffer, and the stream order around each batch (device_event.h).
//
// Fused device batch (docs/algorithms.md §1-2, the same tensors, order, threshold
// and cycle time as host fusion; the coordinator makes every rank fuse alike):
//   pack      k tensors -> the mover's fusion buffer (one kernel on the GPU)
//   allreduce the buffer, by the device path (CUDA-aware MPI) or the staged one
//   unpack    buffer -> k outputs, the average's 1/N fused in (fp16/bf16 pre-divided)
// Bytes: sum of the tensors' bytes, once in and once out of the buffer, which
// is cached and grown geometrically (MemoryMover::fusion_memory).
#include <map>

#include "engine.h"
#include "memory_mover.h"
#include "timeline.h"

namespace pycomm {
namespace comm {

bool Engine::device_fusion(const AllreduceArgs& head) const {
  return head.input.device != Device::CPU || active_.force_staging || active_.force_device_direct;
}

MemoryMover& Engine::mover_of_event(const DeviceEvent& e) {
  Buffer b;
  b.device = e.device() < 0 ? Device::CPU : Device::CUDA;
  b.device_index = e.device();
  return mover_for(b);
}

void Engine::run_device_fused(const std::vector<Op*>& ops) {
  const AllreduceArgs& head = ops.front()->allreduce;
  const DType dtype = head.input.dtype;
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  std::vector<size_t> counts;
  size_t total = 0;
  for (const Op* op : ops) {
    srcs.push_back(op->allreduce.input.data);
    dsts.push_back(op->allreduce.output.data);
    counts.push_back(op->allreduce.input.count);
    total += op->allreduce.input.count;
  }
  MemoryMover& mover = mover_for(head.input);
  MemoryMover::Lease flat = mover.fusion_memory(total * kernels::dtype_size(dtype));
  timeline::Phase phase("DEVICE_PACK");
  mover.pack(srcs.data(), counts.data(), counts.size(), flat.get(), dtype);
  double unpack_scale = 1.0;
  AllreduceArgs fused = fused_args(head, flat.get(), total, &unpack_scale);
  phase.next(nullptr);
  run_allreduce(fused);
  phase.next("DEVICE_UNPACK");
  mover.unpack(flat.get(), dsts.data(), counts.data(), counts.size(), dtype, unpack_scale);
}

void Engine::await_ready(const std::vector<Op*>& batch, size_t count) {
  // A fused batch is first touched by the pack kernel on the mover's lane, so
  // ordering the lanes after the producer is enough. Everything else may hand
  // the pointers to MPI or to host copies at once: the engine thread (never
  // the submitter's) also waits for the producer.
  const bool stream_only = count > 1 && batch.front()->fusable && coordinator_.join_info().joined == 0;
  uint64_t waited = 0;
  for (size_t i = 0; i < count; ++i) {
    const EventPtr& ev = batch[i]->work->ready;
    if (!ev) continue;
    mover_of_event(*ev).wait_event(*ev);
    if (!stream_only) ev->synchronize();
    ++waited;
  }
  if (waited) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.ready_waits += waited;
  }
}

void Engine::record_done(const std::vector<Op*>& batch, size_t count) {
  // One event per device for the whole batch, recorded after the mover's last work.
  std::map<int, EventPtr> done;
  for (size_t i = 0; i < count; ++i) {
    Work& w = *batch[i]->work;
    if (!w.ready) continue;
    const int device = w.ready->device();
    auto it = done.find(device);
    if (it == done.end()) it = done.emplace(device, mover_of_event(*w.ready).record_done()).first;
    w.set_done_event(it->second);
    w.ready.reset();  // back to its pool
  }
  if (!done.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.done_events += done.size();
  }
}

}  // namespace comm
}  // namespace pycomm
