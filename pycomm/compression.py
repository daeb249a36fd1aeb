"""Compressed allreduce: one Compressor interface for none, fp16, bf16 and onebit.

    import pycomm
    pycomm.allreduce(grad, op="avg", compression="fp16")
    pycomm.allreduce(grad, op="avg", compression="onebit", name="fc.weight")

    c = pycomm.compression.OneBit()            # a compressor of your own, with its own state
    c.set_mask("emb.weight", rows_in_use)      # masked-out elements stay exactly 0
    pycomm.allreduce(grad, op="avg", compression=c, name="emb.weight")
    torch.save(c.state_dict(), f"residuals.rank{pycomm.rank()}.pt")

The math is docs/algorithms.md §2:

- ``fp16`` / ``bf16``: y = half(x / N) on every rank (pre-division, so an
  average of values near the top of the fp16 range cannot overflow), a ring
  allreduce of the half buffer whose partial sums are combined in fp32 on
  every hop (one rounding per hop), and a cast back to float32. Half the wire
  bytes of float32.
- ``onebit``: the two-phase scheme of DeepSpeed's compressed allreduce with
  error feedback on both sides. n is padded to a multiple of 8N and cut into
  N chunks of m elements. Each worker quantizes c = x + e_w chunk by chunk
  (s_j = ||c_j||_2 / sqrt(n_j), bit = c >= 0, e_w <- c - s_j sign), sends
  chunk j's bits and scale to rank j (all-to-all); rank j averages the N
  decompressed chunks, adds its server residual e_s and quantizes again with
  its own scale; an allgather of the server chunks gives every rank the same
  result. Wire bytes per rank 2 (N-1) (m/8 + 4): about 1/32 of a float32 ring
  (2 S/32 instead of 2 S). The residuals e_w (n floats) and e_s (m floats)
  are training state, kept per tensor name, in ``state_dict()``.

Contract for all of them: the input is a contiguous float32 tensor on the
host or on a CUDA device; op is "avg" or "sum"; every rank ends with bitwise
the same result. On a CUDA tensor the cast, the sign packing, the scales and
the error feedback run with pycomm's CUDA kernels on the device, only the
compressed bytes cross MPI (device pointers on a CUDA-aware MPI, pinned host
chunks otherwise), and the onebit residuals live on the tensor's device. A tensor that
holds inf or NaN on any rank (or, for fp16, a value beyond the fp16 range
after the pre-division) is *reported, not spread*: every rank raises
``pycomm.CommError`` naming the offending ranks, and neither the output nor
any residual is changed.

More compressors live in pycomm/compressors/, one file each, registered in this module's registry by that package:
``powersgd`` (rank r low-rank with warm start and error feedback), ``topk``
and ``threshold`` (sparsification with error feedback, exchanged as (index,
value) pairs); a parameter follows the name: ``"powersgd:2"``,
``"topk:0.01"``, ``"threshold:0.005"`` (docs/seeds-methods.md).

A new compressor plugs in without touching the engine: subclass
:class:`Compressor`, implement ``compress``/``decompress`` (the generic path
allgathers the compressed payloads and reduces the decompressed tensors in
rank order), and ``register`` it under a name.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _C, _ops, kernels
from .runtime import size

COMPRESSED_OPS = ("avg", "sum")


def _label(name: Optional[str]) -> str:
    return f" '{name}'" if name else ""


class InFlightByName:
    """Handles in flight per tensor name, for compressors with per-name state.

    A handle's completion updates the name's residuals; ``state_dict()``,
    ``load_state_dict()`` and ``reset()`` call ``_wait_pending()`` first so
    that they see (and replace) the state after every call already started.
    """

    def _init_pending(self) -> None:
        self._pending: Dict[str, Any] = {}
        self._lock = threading.Lock()

    def _track(self, name: str, handle) -> None:
        with self._lock:
            self._pending[name] = handle

    def _untrack(self, name: str, handle) -> None:
        """A finished handle leaves the table, unless a later call of `name` replaced it."""
        with self._lock:
            if self._pending.get(name) is handle:
                del self._pending[name]

    def _wait_previous(self, name: str) -> None:
        """The previous call of `name` must finish before its state is reused."""
        with self._lock:
            prev = self._pending.pop(name, None)
        if prev is not None:
            prev.wait()

    def _wait_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for h in pending.values():
            try:
                h.wait()
            except Exception:  # the error belongs to whoever waits on the handle
                pass


class Compressor:
    """The interface every compression implements.

    ``allreduce_async(tensor, op, name, out)`` starts an allreduce and returns a
    handle whose ``wait()`` gives the result (``out``, or ``tensor`` in place).
    The default implementation is generic: ``compress`` each rank's tensor,
    allgather the payloads, ``decompress`` every rank's payload and reduce in
    rank order (the same on every rank). Engine-backed compressors (fp16,
    bf16, onebit) override it.

    State (error-feedback residuals and the like) is per tensor name and goes
    through ``state_dict()`` / ``load_state_dict()``; it is this rank's state,
    so checkpoint it per rank.
    """

    name = "custom"

    # ---- what to override ----
    def supports(self, dtype: torch.dtype) -> bool:
        """True if this compressor can reduce tensors of `dtype`."""
        return dtype.is_floating_point

    def compress(self, tensor: torch.Tensor, name: Optional[str]) -> Tuple[List[torch.Tensor], Any]:
        """Return (payload tensors, ctx). ctx must be the same on every rank (shape, dtype)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither compress() nor allreduce_async()")

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """Rebuild one rank's tensor from its payload."""
        raise NotImplementedError(f"{type(self).__name__} implements neither decompress() nor allreduce_async()")

    def wire_bytes(self, numel: int, world_size: int, rank: int = 0) -> int:
        """Bytes `rank` sends to allreduce `numel` float32 elements (estimate for the generic path)."""
        return 0

    def state_dict(self) -> Dict[str, Any]:
        return {"compression": self.name}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        got = state.get("compression")
        if got != self.name:
            raise ValueError(f"state_dict is for compression {got!r}, not {self.name!r}")

    def reset(self, name: Optional[str] = None) -> None:
        """Forget the state of tensor `name` (all tensors if None)."""

    def set_layout(self, name: str, shapes: Sequence[Sequence[int]]) -> None:
        """Say that the flat tensor `name` is the concatenation of tensors of these shapes (a bucket).

        Compressors that work per tensor (powersgd: one rank-r pair per 2-D
        gradient) use it; the others ignore it.
        """

    def wire_bytes_named(self, name: Optional[str], numel: int, world_size: int, rank: int = 0) -> int:
        """Bytes `rank` sent for its last allreduce of tensor `name` (default: ``wire_bytes(numel, ...)``)."""
        return self.wire_bytes(numel, world_size, rank)

    # ---- the collective ----
    def check(self, tensor: torch.Tensor, op: str, name: Optional[str]) -> None:
        """Raise TypeError/ValueError unless this compressor can reduce `tensor` with `op`."""
        if op not in COMPRESSED_OPS:
            raise ValueError(f"pycomm.allreduce: compression={self.name!r} supports op 'avg' or 'sum', got {op!r}")
        if not self.supports(tensor.dtype):
            raise TypeError(f"pycomm.allreduce: compression={self.name!r} cannot reduce tensor{_label(name)} of dtype "
                            f"{str(tensor.dtype).replace('torch.', '')}; it takes float32 "
                            "(use compression='none' for other dtypes)")

    def allreduce_async(self, tensor: torch.Tensor, op: str = "avg", name: Optional[str] = None,
                        out: Optional[torch.Tensor] = None, _blocking: bool = False):
        self.check(tensor, op, name)
        payload, ctx = self.compress(tensor, name)
        handles = []
        for i, p in enumerate(payload):
            flat = p.reshape(-1).contiguous()
            tag = f"{name or ''}.c{i}"
            handles.append((_ops.allgather_async(flat, name=tag),
                            _ops.allgather_async(torch.tensor([flat.numel()], dtype=torch.int64), name=tag + ".n"),
                            p.shape[1:] if p.dim() > 1 else None))
        return _GenericHandle(self, handles, ctx, tensor, out if out is not None else tensor, op)


class _GenericHandle:
    """Handle of the generic compress/allgather/decompress path; the reduction runs in wait()."""

    def __init__(self, compressor, handles, ctx, tensor, out, op):
        self._c, self._handles, self._ctx, self._out, self._op = compressor, handles, ctx, out, op
        self._result: Optional[torch.Tensor] = None

    def done(self) -> bool:
        return self._result is not None or all(h.done() and n.done() for h, n, _ in self._handles)

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        per_rank: Optional[List[List[torch.Tensor]]] = None
        for h, n, _ in self._handles:
            data, counts = h.wait(), n.wait().tolist()
            parts = list(torch.split(data, counts))
            if per_rank is None:
                per_rank = [[] for _ in parts]
            for r, part in enumerate(parts):
                per_rank[r].append(part)
        acc = torch.zeros(self._out.shape, dtype=torch.float64)
        for payload in per_rank or []:
            acc += self._c.decompress(payload, self._ctx).reshape(self._out.shape).double()
        if self._op == "avg" and per_rank:
            acc /= len(per_rank)
        self._out.copy_(acc)
        self._result = self._out
        return self._out


class NoCompression(Compressor):
    """float32 (or any dtype) on the wire: pycomm's plain allreduce."""

    name = "none"

    def supports(self, dtype: torch.dtype) -> bool:
        return True

    def check(self, tensor, op, name) -> None:
        pass  # pycomm.allreduce checks everything

    def compress(self, tensor, name):
        return [tensor], None

    def decompress(self, payload, ctx):
        return payload[0]

    def wire_bytes(self, numel: int, world_size: int, rank: int = 0) -> int:
        return int(_C.ring_wire_bytes(numel, 4, world_size, rank))

    def allreduce_async(self, tensor, op="avg", name=None, out=None, _blocking=False):
        return _ops.allreduce_async(tensor, op=op, out=out, name=name, blocking=_blocking)


class Float32Compressor(Compressor):
    """A compression of float32 tensors on the host or a CUDA device (the engine's, and those under
    pycomm/compressors/). ``kept_per_name``: what it keeps per tensor name, if anything; then
    ``name=`` is required."""

    kept_per_name: Optional[str] = None

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32

    def check(self, tensor, op, name) -> None:
        super().check(tensor, op, name)
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"pycomm.allreduce: compression={self.name!r} handles CPU and CUDA tensors; "
                             f"tensor{_label(name)} is on {tensor.device}")
        if self.kept_per_name and not name:
            raise ValueError(f"pycomm.allreduce(compression={self.name!r}) needs name=: {self.kept_per_name} are "
                             "kept per tensor name")

    @staticmethod
    def _check_out(tensor, out, name) -> None:
        if out is not None and out is not tensor and out.device != tensor.device:
            raise ValueError(f"pycomm.allreduce: out is on {out.device} but tensor{_label(name)} on "
                             f"{tensor.device}; pass out on the tensor's device")


class _EngineCompressor(Float32Compressor):
    """A compression that pycomm's C++ engine runs (float32 tensors, host or CUDA)."""

    def wire_bytes(self, numel: int, world_size: int, rank: int = 0) -> int:
        return int(_C.compressed_wire_bytes(self.name, numel, world_size, rank))


class _HalfCompressor(_EngineCompressor):
    half_dtype = torch.float16

    def compress(self, tensor, name):
        return [tensor.to(self.half_dtype)], None

    def decompress(self, payload, ctx):
        return payload[0].float()

    def allreduce_async(self, tensor, op="avg", name=None, out=None, _blocking=False):
        self.check(tensor, op, name)
        self._check_out(tensor, out, name)
        out = tensor if out is None else out
        return _C.compressed_allreduce_async(tensor, out, self.name, op == "avg", None, None, None, name or "",
                                             _blocking)


class FP16(_HalfCompressor):
    """float16 on the wire, pre-divided by N for averages, partial sums combined in fp32.

    Relative error of the result about 2^-11 per hop. Values beyond 65504 * N
    (after the pre-division: beyond 65504) are reported, not turned into inf:
    use BF16 for gradients with a wide range.
    """

    name = "fp16"
    half_dtype = torch.float16


class BF16(_HalfCompressor):
    """bfloat16 on the wire: float32's range, 8 bits of precision (relative error about 2^-8 per hop)."""

    name = "bf16"
    half_dtype = torch.bfloat16


class OneBit(InFlightByName, _EngineCompressor):
    """1 bit per element with error feedback, two-phase (DeepSpeed's compressed allreduce).

    Every tensor needs a ``name``: its residuals (the worker's e_w, n floats,
    and this rank's server chunk e_s, m floats) are kept under that name and
    carried from one call to the next; that memory is what makes 1-bit
    compression converge. The residuals of a name are created (zero) at its
    first call; a later call with a different size raises ValueError unless
    ``reset(name)`` is called first.

    Mask: ``set_mask(name, mask)`` (or ``mask=`` per call) with a bool/uint8
    tensor of the tensor's size; where it is 0 the result is exactly 0 and the
    residuals stay 0 (zero would otherwise be sent as +scale: DeepSpeed's
    exp_avg_mask). Masks are configuration, not state: they are not in
    ``state_dict()``.

    Training: with plain SGD on the compressed gradient average the final
    loss matches float32 closely; heavy-ball momentum on top of 1-bit
    gradients lags (compress the momentum instead, as 1-bit Adam does).

    Device: the residuals of a tensor live on its device (a CUDA tensor's
    on its GPU, updated there by the CUDA kernels); a mask set on the host is
    copied to the tensor's device once and kept there.

    Checkpoints: ``state_dict()`` waits for the calls in flight and returns
    copies of this rank's residuals (on their device) with the world size;
    loaded residuals move to the tensor's device at its next call. Loading into a job of
    another world size keeps the worker residuals and zeroes the server
    residuals (their chunks belong to other ranks then), with a warning.
    """

    name = "onebit"

    def __init__(self, masks: Optional[Dict[str, torch.Tensor]] = None):
        self._residuals = _C.OnebitResiduals()  # error feedback per name (the c10d backend's store too)
        self._masks: Dict[str, torch.Tensor] = {}
        self._device_masks: Dict[Tuple[str, torch.device], torch.Tensor] = {}  # masks copied to a device
        self._init_pending()
        for k, v in (masks or {}).items():
            self.set_mask(k, v)

    # ---- masks ----
    @staticmethod
    def _as_mask(mask: torch.Tensor, numel: Optional[int], name: Optional[str]) -> torch.Tensor:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"onebit mask{_label(name)}: expected a tensor, got {type(mask).__name__}")
        if numel is not None and mask.numel() != numel:
            raise ValueError(f"onebit mask{_label(name)} has {mask.numel()} elements, the tensor {numel}")
        if mask.dtype not in (torch.bool, torch.uint8):
            mask = mask != 0
        return mask.reshape(-1).contiguous().to(torch.uint8)

    def set_mask(self, name: str, mask: Optional[torch.Tensor]) -> None:
        """Keep the elements of tensor `name` where `mask` is 0 exactly zero (None removes the mask)."""
        self._device_masks = {k: v for k, v in self._device_masks.items() if k[0] != name}
        if mask is None:
            self._masks.pop(name, None)
        else:
            self._masks[name] = self._as_mask(mask, None, name)

    def _mask_on(self, name: str, device: torch.device) -> Optional[torch.Tensor]:
        mask = self._masks.get(name)
        if mask is None or mask.device == device:
            return mask
        key = (name, device)
        if key not in self._device_masks:
            self._device_masks[key] = mask.to(device)
        return self._device_masks[key]

    # ---- state ----
    def residuals(self, name: str) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(worker, server) residual tensors of `name`, or None (live tensors, not copies)."""
        return self._residuals.get(name)

    def names(self) -> List[str]:
        return self._residuals.names()

    def _residuals_for(self, name: str, tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._residuals.for_call(name, tensor, size())
        except ValueError as e:
            raise ValueError(f"{e}; names must be unique per tensor (or call reset('{name}'))") from None

    def state_dict(self) -> Dict[str, Any]:
        self._wait_pending()
        residuals = {}
        for k in self._residuals.names():
            worker, server = self._residuals.get(k)
            residuals[k] = {"worker": worker.clone(), "server": server.clone()}
        return {"compression": self.name, "world_size": size(), "residuals": residuals}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._wait_pending()
        world = size()
        saved_world = int(state.get("world_size", world))
        if saved_world != world and state.get("residuals"):
            warnings.warn(f"onebit: residuals saved at {saved_world} ranks, loading at {world}: worker residuals "
                          "kept, server residuals reset to zero", RuntimeWarning, stacklevel=2)
        self._residuals.clear()
        for k, v in state.get("residuals", {}).items():
            worker = v["worker"].detach().to(torch.float32).reshape(-1).contiguous().clone()
            _, chunk = _C.onebit_layout(worker.numel(), world)
            server = v["server"].detach().to(torch.float32).reshape(-1).contiguous().clone()
            if saved_world != world or server.numel() != chunk:
                server = torch.zeros(chunk, dtype=torch.float32)
            self._residuals.put(k, worker, server, world)

    def reset(self, name: Optional[str] = None) -> None:
        self._wait_pending()
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name)

    # ---- generic interface (one rank, no communication) ----
    def compress(self, tensor, name):
        """Worker side only: (bits uint8, scales float32) of tensor + residual, updating the worker residual."""
        worker, _ = self._residuals_for(name or "", tensor)
        _, chunk = _C.onebit_layout(tensor.numel(), size())
        bits, scales = kernels.onebit_compress(tensor.reshape(-1).contiguous().float(), worker, chunk=max(chunk, 8),
                                               mask=self._mask_on(name or "", tensor.device))
        return [bits, scales], (tensor.shape, max(chunk, 8), self._mask_on(name or "", tensor.device))

    def decompress(self, payload, ctx):
        shape, chunk, mask = ctx
        n = 1
        for d in shape:
            n *= int(d)
        return kernels.onebit_decompress(payload[0], payload[1], n, chunk=chunk, mask=mask).reshape(shape)

    # ---- the collective ----
    def allreduce_async(self, tensor, op="avg", name=None, out=None, _blocking=False, mask=None):
        self.check(tensor, op, name)
        self._check_out(tensor, out, name)
        if not name:
            raise ValueError("pycomm.allreduce(compression='onebit') needs name=: the error-feedback residuals are "
                             "kept per tensor name")
        out = tensor if out is None else out
        if mask is not None:
            mask = self._as_mask(mask, tensor.numel(), name)
            if mask.device != tensor.device:
                raise ValueError(f"onebit mask '{name}' is on {mask.device}, the tensor on {tensor.device}; pass "
                                 "the mask on the tensor's device (or set_mask() it once)")
        else:
            mask = self._mask_on(name, tensor.device)
            if mask is not None and mask.numel() != tensor.numel():
                raise ValueError(f"onebit mask '{name}' has {mask.numel()} elements, the tensor {tensor.numel()}")
        worker, server = self._residuals_for(name, tensor)
        h = _C.compressed_allreduce_async(tensor, out, "onebit", op == "avg", worker, server, mask, name,
                                          _blocking)
        self._track(name, h)
        return h


_REGISTRY: Dict[str, Callable[[], Compressor]] = {
    "none": NoCompression,
    "fp16": FP16,
    "bf16": BF16,
    "onebit": OneBit,
}
# name -> factory(parameter string) for "name:parameter" (e.g. "powersgd:4", "topk:0.001").
_SPEC: Dict[str, Callable[[str], Compressor]] = {}
_DEFAULTS: Dict[str, Compressor] = {}


def register(name: str, factory: Callable[[], Compressor],
             from_spec: Optional[Callable[[str], Compressor]] = None) -> None:
    """Make `name` usable as ``compression=name`` everywhere (factory() builds a fresh compressor).

    from_spec(parameter) builds one from ``compression="name:parameter"``.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError("register: name must be a non-empty string without ':'")
    _REGISTRY[name] = factory
    if from_spec is not None:
        _SPEC[name] = from_spec
    else:
        _SPEC.pop(name, None)


def names() -> Tuple[str, ...]:
    """Every compression name known now (the built-ins first)."""
    return tuple(_REGISTRY)


def _choices() -> str:
    return ", ".join(n + (" (or " + n + ":PARAM)" if n in _SPEC else "") for n in _REGISTRY)


def known(spec) -> bool:
    """True if `spec` is a registered name, or "name:parameter" of a name that takes a parameter."""
    if not isinstance(spec, str):
        return False
    base, sep, _ = spec.partition(":")
    return base in _REGISTRY and (not sep or base in _SPEC)


def by_name(name: str) -> Compressor:
    """A new compressor (with fresh state) for `name`: none | fp16 | bf16 | onebit | powersgd[:rank] |
    topk[:ratio] | threshold[:value] | a registered one."""
    if not known(name):
        raise ValueError(f"unknown compression {name!r}; choose one of {_choices()}")
    base, sep, param = name.partition(":")
    if sep:
        return _SPEC[base](param)
    return _REGISTRY[name]()


def default(name: str) -> Compressor:
    """The process-wide compressor behind ``compression=name`` (its residuals live here)."""
    if name not in _DEFAULTS:
        _DEFAULTS[name] = by_name(name)
    return _DEFAULTS[name]


def resolve(compression) -> Compressor:
    """A Compressor for ``compression=`` (a name, or a Compressor passed through)."""
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, str):
        return default(compression) if known(compression) else by_name(compression)
    raise TypeError(f"compression must be a name ({', '.join(_REGISTRY)}) or a pycomm.compression.Compressor, "
                    f"got {type(compression).__name__}")

