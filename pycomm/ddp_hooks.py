"""Communication hooks for torch DistributedDataParallel that run pycomm's engine.

DDP keeps its bucketing, overlap with backward and its process group (gloo
is enough: it only broadcasts the initial parameters); the gradient
allreduce of every bucket goes through pycomm's engine instead, compressed:

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import pycomm, pycomm.ddp_hooks as hooks

    pycomm.init()
    dist.init_process_group("gloo", ...)       # same ranks as MPI
    model = DDP(model)
    state = hooks.OneBitState()
    model.register_comm_hook(state, hooks.onebit_hook)
    ...
    torch.save({"model": model.state_dict(), "hook": state.state_dict()}, f"ckpt.rank{pycomm.rank()}.pt")

Hooks: ``fp16_hook`` (with :class:`FP16State`), ``bf16_hook``
(:class:`BF16State`), ``onebit_hook`` (:class:`OneBitState`),
``powersgd_hook`` (:class:`PowerSGDState`), ``topk_hook`` (:class:`TopKState`),
``threshold_hook`` (:class:`ThresholdState`), and
``allreduce_hook`` (:class:`AllreduceState`, no compression) as a baseline.
Each returns a future that completes when pycomm's engine has averaged the
bucket; a background thread turns engine completions into completed
futures, so backward keeps running meanwhile. (No ``from __future__ import
annotations`` here: DDP checks the hooks' return annotation as an object.)

Buckets are named ``{state.prefix}.bucket{index}``: the same on every rank,
so pycomm's agreement check compares them. Compression needs float32
buckets; any other dtype is averaged uncompressed.

CUDA buckets: an uncompressed bucket is handed to the engine on the device,
stream-ordered: the engine waits on an event recorded on the backward
stream (no host block in the hook), and the future (created with the
bucket's device) completes on a pycomm side stream ordered after the
engine's device work, so DDP's stream waits for it on the device. A bucket
that is compressed stays on the device too: the engine runs the fp16/bf16
casts and the 1-bit compression with error feedback on the device, and the
residuals stay there (pycomm.compression).
"""
import queue
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from . import collectives
from .compression import BF16, FP16, Compressor, NoCompression, OneBit

__all__ = ["AllreduceState", "BF16State", "FP16State", "HookState", "OneBitState", "PowerSGDState", "ThresholdState",
           "TopKState", "allreduce_hook", "bf16_hook", "fp16_hook", "onebit_hook", "powersgd_hook", "threshold_hook",
           "topk_hook"]


class _Completer:
    """One daemon thread: waits on pycomm handles in submission order, completes torch futures."""

    def __init__(self):
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._streams: Dict[int, Any] = {}  # CUDA device index -> side stream (the completer thread only)

    def submit(self, handle, fut: torch.futures.Future, finish: Callable[[], torch.Tensor],
               device: Optional[torch.device] = None) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="pycomm-ddp-hooks", daemon=True)
                self._thread.start()
        self._queue.put((handle, fut, finish, device))

    def _run(self) -> None:
        while True:
            handle, fut, finish, device = self._queue.get()
            try:
                if device is None:
                    handle.wait()  # releases the GIL
                    fut.set_result(finish())
                    continue
                # CUDA: wait() orders the current stream after the engine's device work (no host wait on
                # the device); set_result records the future's event on that same stream.
                stream = self._streams.get(device.index)
                if stream is None:
                    stream = self._streams[device.index] = torch.cuda.Stream(device=device)
                with torch.cuda.stream(stream):
                    handle.wait()
                    fut.set_result(finish())
            except Exception as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)


_completer = _Completer()


class HookState:
    """Base of the hook states: a compressor, a bucket-name prefix and an iteration counter.

    ``state_dict()`` / ``load_state_dict()`` carry the iteration and the
    compressor's state (this rank's; checkpoint it per rank).
    """

    compression = "none"

    def __init__(self, compressor: Compressor, prefix: str = "ddp"):
        self.compressor = compressor
        self.prefix = prefix
        self.iteration = 0  # completed backward passes (counted at the last bucket)
        self.wire_bytes = 0  # bytes this rank sent through the hook so far
        self._layouts: Dict[int, Tuple] = {}
        self.layout_resets = 0  # buckets whose residuals were dropped because DDP changed their layout

    def bucket_name(self, index: int) -> str:
        return f"{self.prefix}.bucket{index}"

    def state_dict(self) -> Dict[str, Any]:
        return {"compression": self.compression, "iteration": self.iteration, "wire_bytes": self.wire_bytes,
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("compression") != self.compression:
            raise ValueError(f"hook state is for compression {state.get('compression')!r}, "
                             f"not {self.compression!r}")
        self.iteration = int(state["iteration"])
        self.wire_bytes = int(state.get("wire_bytes", 0))
        self.compressor.load_state_dict(state["compressor"])

    def _use_compression(self, bucket) -> bool:
        return not isinstance(self.compressor, NoCompression)


class AllreduceState(HookState):
    """No compression: DDP's float32 average through pycomm's engine (a baseline for the others).

    Tuning: nothing to tune here; DDP's ``bucket_cap_mb`` sets the message
    size (pycomm's ring reaches full bandwidth from about 1 MiB).
    """

    compression = "none"

    def __init__(self, prefix: str = "ddp"):
        super().__init__(NoCompression(), prefix)


class FP16State(HookState):
    """float16 on the wire: half of float32's bytes.

    Tuning guide:
    - Each rank's gradient is divided by N before the cast, so averages never
      overflow; values beyond 65504 after that division (or inf/NaN) make every
      rank raise pycomm.CommError instead of spreading inf. With mixed
      precision and loss scaling, catch that error and skip the step (halve the
      scale), as a dynamic loss scaler does.
    - Precision: about 3 significant digits per hop. Gradients whose useful
      part lies below 2^-24 * N (fp16's smallest subnormal) flush to zero; if
      that matters, use BF16State.
    - No state beyond the iteration counter; ``state_dict()`` is tiny.
    """

    compression = "fp16"

    def __init__(self, prefix: str = "ddp"):
        super().__init__(FP16(), prefix)


class BF16State(HookState):
    """bfloat16 on the wire: half of float32's bytes with float32's range.

    Tuning guide:
    - Cannot overflow where float32 does not; only inf/NaN inputs are reported
      (pycomm.CommError on every rank).
    - 8 bits of precision (about 2-3 digits) per hop: a little noisier than
      FP16State, never out of range. The safe default for half-width traffic.
    """

    compression = "bf16"

    def __init__(self, prefix: str = "ddp"):
        super().__init__(BF16(), prefix)


class _ResidualLayoutState(HookState):
    """A state whose residuals are tied to a bucket's layout: a changed layout resets them (onebit, topk, threshold)."""

    residual_layouts = True

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["layouts"] = dict(self._layouts)
        return sd

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._layouts = dict(state.get("layouts", {}))


class _WarmUpState(HookState):
    """Averages in float32 for the first ``warmup_steps`` iterations, then compresses (onebit, powersgd)."""

    def __init__(self, warmup_steps: int, make_compressor: Callable[[], Compressor], prefix: str):
        # Checked before the compressor exists: PowerSGD's creates a process group, a collective call.
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"{type(self).__name__}: warmup_steps must be a non-negative integer, "
                             f"got {warmup_steps!r}")
        super().__init__(make_compressor(), prefix)
        self.warmup_steps = warmup_steps

    def _use_compression(self, bucket) -> bool:
        return self.iteration >= self.warmup_steps


class OneBitState(_WarmUpState, _ResidualLayoutState):
    """1 bit per gradient element with error feedback (two-phase): ~1/32 of float32's bytes.

    Tuning guide:
    - warmup_steps [0]: iterations that use the float32 average before 1-bit
      starts (DeepSpeed's 1-bit Adam freezes after a warm-up; torch's PowerSGD
      hook starts after ``start_powerSGD_iter``). Plain SGD with momentum
      usually trains fine from step 0; raise it to a few hundred steps for
      large models or adaptive optimizers whose first steps are large.
    - Learning rate: 1-bit compression adds noise that error feedback repays
      over later steps. Keep the learning rate of the uncompressed run; if the
      loss is noisier, lower it by about 2x or use a warm-up.
    - Momentum: with plain SGD, 1-bit gradients reach the uncompressed loss
      (within about 1% in tests/parallel/test_compression_training.py). Heavy-
      ball momentum applied *after* the 1-bit average lags (+13% to +38% final
      loss at momentum 0.9 on the same task): lower the momentum, or compress
      the momentum itself as DeepSpeed's 1-bit Adam does.
    - Residuals: one worker residual (bucket size) and one server residual
      (bucket size / N) per bucket, kept in float32: about 1 + 1/N times the
      gradient memory. They are training state: save ``state_dict()`` with the
      checkpoint, per rank, and load it on resume.
    - DDP rebuilds its buckets once, after the first iteration (usually into
      reverse parameter order). Residuals are tied to a bucket's layout (the
      shapes of its parameters, in order): a bucket whose layout changed starts
      again from zero residuals rather than feeding one parameter's residual
      into another (``layout_resets`` counts these). So a resumed job loses
      its residuals at that rebuild unless the layout stays fixed; DDP keeps
      its first layout with ``find_unused_parameters=True``, and then a
      resumed run continues bitwise like one that was never stopped.
    - masks: ``{bucket_index: mask}`` keeps chosen elements of a bucket exactly
      zero (DeepSpeed's exp_avg_mask); rarely needed for gradients.
    """

    compression = "onebit"

    def __init__(self, warmup_steps: int = 0, prefix: str = "ddp", masks: Optional[Dict[int, torch.Tensor]] = None):
        super().__init__(warmup_steps, OneBit, prefix)
        for index, mask in (masks or {}).items():
            self.compressor.set_mask(self.bucket_name(index), mask)


class PowerSGDState(_WarmUpState):
    """Rank-r PowerSGD with warm start and error feedback (pycomm.compressors.powersgd; docs/seeds-methods.md).

    Tuning guide:
    - rank [1]: columns of P and Q per 2-D gradient. Bytes per step are
      r (n + m) instead of n m per n x m gradient; rank 1-4 is the usual range
      (Vogels et al.: rank 2 matched full precision on ResNet-18/CIFAR-10).
    - warmup_steps [0]: iterations averaged in float32 before PowerSGD starts
      (torch's hook: ``start_powerSGD_iter``).
    - 1-D parameters (biases, norms) and 2-D ones too small to gain travel
      exactly, in the same allreduce as the P's.
    - State: this rank's residual (the bucket's size) and the Q's (shared),
      per bucket; save ``state_dict()`` per rank. A bucket whose layout
      changes (DDP's rebuild after the first iteration) starts afresh
      (``compressor.layout_resets``).
    - Construction is collective (every rank, the same point): the Q
      allreduce runs on a process group of its own, so the hook's two phases
      keep one order on every rank while backward goes on.
    """

    compression = "powersgd"

    def __init__(self, rank: int = 1, warmup_steps: int = 0, prefix: str = "ddp", seed: int = 0):
        from .compressors.powersgd import PowerSGD
        from .groups import new_group
        from .runtime import size

        super().__init__(warmup_steps, lambda: PowerSGD(rank=rank, seed=seed, q_group=new_group(list(range(size())))),
                         prefix)


def powersgd_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with rank-r PowerSGD (two allreduces: [exact, P], then Q) with error feedback."""
    return _run(state, bucket)


class TopKState(_ResidualLayoutState):
    """Top-k sparsification with error feedback (pycomm.compressors.topk; docs/seeds-methods.md).

    Tuning guide:
    - ratio [0.01]: fraction of each bucket's elements sent per step, as
      (int32 index, float32 value) pairs through an allgather: 8 (N - 1) K
      bytes per rank against about 8 n for float32 with a ring, so it pays off
      for ratio below about 1 / N.
    - The residual (bucket size, float32) is training state: save
      ``state_dict()`` per rank. DDP's bucket rebuild after the first
      iteration keeps the residuals only if the layout stays (as onebit).
    """

    compression = "topk"

    def __init__(self, ratio: float = 0.01, prefix: str = "ddp"):
        from .compressors.topk import TopK

        super().__init__(TopK(ratio), prefix)


class ThresholdState(_ResidualLayoutState):
    """Threshold sparsification with error feedback (pycomm.compressors.threshold; docs/seeds-methods.md).

    Tuning guide:
    - value [0.001]: |gradient + residual| at or above which an element is
      sent; it depends on the gradients' scale. The ranks agree on
      K = max of their counts (one small allreduce per bucket, which waits in
      the hook), ``compressor.last_k(name)`` shows it.
    """

    compression = "threshold"

    def __init__(self, value: float = 1e-3, prefix: str = "ddp"):
        from .compressors.threshold import Threshold

        super().__init__(Threshold(value), prefix)


def topk_hook(state: TopKState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's top-k elements (error feedback) through an (index, value) allgather."""
    return _run(state, bucket)


def threshold_hook(state: ThresholdState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's elements above the threshold (error feedback) through an (index, value) allgather."""
    return _run(state, bucket)


def _layout(bucket) -> Tuple:
    return tuple(tuple(p.shape) for p in bucket.parameters())


def _run(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    index = bucket.index()
    name = state.bucket_name(index)
    compress = buf.dtype == torch.float32 and state._use_compression(bucket)
    if bucket.is_last():
        state.iteration += 1
    cuda = buf.device.type == "cuda"
    # CUDA buckets stay on the device: the engine and the compressors take device memory.
    host = buf
    if compress:
        if isinstance(state.compressor, OneBit) or getattr(state, "residual_layouts", False):
            layout = _layout(bucket)
            if state._layouts.get(index) != layout:
                if index in state._layouts:
                    state.compressor.reset(name)
                    state.layout_resets += 1
                state._layouts[index] = layout
        else:  # per-tensor compressors (powersgd) need the bucket's shapes; the others ignore them
            state.compressor.set_layout(name, _layout(bucket))
        handle = state.compressor.allreduce_async(host, op="avg", name=name)
        from .runtime import rank, size

        state.wire_bytes += state.compressor.wire_bytes_named(name, host.numel(), size(), rank())
    else:
        handle = collectives.allreduce_async(host, op="avg", name=name)
    fut = torch.futures.Future(devices=[buf.device]) if cuda else torch.futures.Future()

    def finish() -> torch.Tensor:
        if host is not buf:
            buf.copy_(host, non_blocking=False)
        return buf

    _completer.submit(handle, fut, finish, buf.device if cuda else None)
    return fut


def allreduce_hook(state: AllreduceState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float32 with pycomm's engine."""
    return _run(state, bucket)


def fp16_hook(state: FP16State, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16 (pre-divided, fp32 partial sums) with pycomm's engine."""
    return _run(state, bucket)


def bf16_hook(state: BF16State, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16 with pycomm's engine."""
    return _run(state, bucket)


def onebit_hook(state: OneBitState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with pycomm's two-phase 1-bit compressed allreduce (error feedback)."""
    return _run(state, bucket)
