"""DistributedOptimizer: synchronous data parallelism by gradient averaging (Horovod style).

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = pycomm.DistributedOptimizer(opt, model.named_parameters())
    pycomm.broadcast_parameters(model.state_dict(), root=0)
    pycomm.broadcast_optimizer_state(opt, root=0)
    for x, y in data:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

How a step works: every parameter carries a post-accumulate-grad hook. The
parameters are cut into buckets (about ``bucket_mb`` MiB each, one dtype
per bucket) in reverse registration order, which is roughly the order in
which backward produces their gradients; the cut is computed from shapes
only, so it is identical on every rank. When the last gradient of a bucket
has arrived the bucket is flattened into one buffer and an asynchronous
allreduce starts while backward goes on. Buckets are started strictly in
bucket order (a bucket that completes early waits for its predecessors), so
every rank submits the same sequence of collectives. ``step()`` starts the
buckets still missing, waits for all, writes the reduced gradients back into
``p.grad`` and lets the wrapped optimizer update.

The result is ``w <- w - eta * avg_k g_k``, the update of one minibatch of
N*b samples (docs/algorithms.md §4, SSGD).

Gradient accumulation: with ``backward_passes_per_step = k`` the gradients
of k backward passes accumulate locally (summed, as torch does) and are
reduced once, on the k-th pass; scale the loss by 1/k for a mean. A
parameter that received no gradient in a step (unused in the forward pass)
counts as a zero gradient on that rank, so every rank reduces the same
buckets; after the step it holds the reduced gradient on every rank.
"""
from __future__ import annotations

import contextlib
import io
import warnings
import weakref
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch

from . import collectives
from . import compression as _compression
from .join import join as _join
from .runtime import rank, size, topology
from .timeline import profiled

#: Compression names DistributedOptimizer accepts (pycomm.compression; a
#: Compressor instance, or a name added with pycomm.compression.register, works too).
SUPPORTED_COMPRESSION: Tuple[str, ...] = collectives.COMPRESSIONS

#: Reduction ops DistributedOptimizer accepts.
SUPPORTED_OPS: Tuple[str, ...] = ("avg", "sum")


def check_compression(compression):
    """Return `compression` if pycomm supports it, else raise ValueError listing the choices."""
    if isinstance(compression, _compression.Compressor):
        return compression
    if not _compression.known(compression):
        raise ValueError(f"unknown compression {compression!r}; supported: {_compression._choices()}")
    return compression


def ring_bytes_sent(payload_bytes: int, world_size: int) -> int:
    """Bytes one rank sends to allreduce `payload_bytes` with a ring: 2(N-1)/N * S (docs/algorithms.md §1)."""
    if world_size <= 1:
        return 0
    return (2 * (world_size - 1) * int(payload_bytes)) // world_size


class _Bucket:
    __slots__ = ("index", "params", "numel", "dtype", "buffer", "ready", "handle")

    def __init__(self, index: int, params: List[torch.nn.Parameter]):
        self.index = index
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        self.buffer: Optional[torch.Tensor] = None
        self.ready = 0
        self.handle = None


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap `optimizer` so that ``step()`` applies gradients averaged over all ranks.

    optimizer: any torch.optim optimizer; its ``param_groups`` and ``state``
        are shared with this wrapper (``isinstance(opt, torch.optim.Optimizer)``
        holds, so LR schedulers work on the wrapper).
    named_parameters: (name, parameter) pairs, e.g. ``model.named_parameters()``;
        names appear in error messages. Default: the optimizer's parameters,
        named by position. Every parameter the optimizer updates must be listed.
    compression: one of SUPPORTED_COMPRESSION (none, fp16, bf16, onebit), a
        registered name such as "powersgd:2", "topk:0.01" or "threshold:0.005"
        (docs/seeds-methods.md), or a pycomm.compression.Compressor. The optimizer gets its own compressor
        (for onebit: its own error-feedback residuals, one pair per bucket,
        saved in ``state_dict()`` under "pycomm_compression", per rank).
        Compression applies to float32 buckets (a CUDA bucket compressed on
        its device by the CUDA kernels); buckets of other dtypes are reduced uncompressed, with one
        warning at construction.
    backward_passes_per_step: backward passes accumulated locally per reduction.
    op: "avg" (default) or "sum" over ranks.
    bucket_mb: target bucket size in MiB (a larger parameter gets its own bucket).
    algorithm: allreduce algorithm passed to ``pycomm.allreduce_async``.
    group: a ``pycomm.new_group()`` group to reduce over (default: all ranks);
        compression needs all ranks. Ranks outside the group keep their own
        gradients.
    sparse_as_dense: how sparse gradients (``nn.Embedding(sparse=True)``) are
        reduced. False: as Horovod's sparse allreduce, an allgather of every
        rank's indices and values (divided by the group size for "avg"); the
        parameter gets a sparse gradient holding all of them. True: densified
        and reduced in the parameter's bucket like any other gradient, then
        made sparse again for the optimizer.

    Counters: ``num_allreduces`` (collectives started), ``bytes_reduced``
    (payload bytes) and ``bytes_sent`` (per-rank ring estimate, 2(N-1)/N * S).
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 compression: str = "none", backward_passes_per_step: int = 1, op: str = "avg",
                 bucket_mb: float = 25.0, algorithm: str = "auto", group=None, sparse_as_dense: bool = False):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("DistributedOptimizer: the optimizer is already distributed; wrap the plain optimizer once")
        if getattr(optimizer, "reduces_gradients", False):
            raise TypeError(f"DistributedOptimizer: {type(optimizer).__name__} is the whole data-parallel step (it "
                            "averages gradients or momenta itself); use it without DistributedOptimizer")
        check_compression(compression)
        if op not in SUPPORTED_OPS:
            raise ValueError(f"DistributedOptimizer: unknown op {op!r}; choose one of {', '.join(SUPPORTED_OPS)}")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb!r}")
        topology()  # raises clearly before init
        if group is not None and not (isinstance(compression, str) and compression == "none"):
            raise ValueError("DistributedOptimizer: compression runs over all ranks; group= needs compression='none'")

        opt_params = [p for group in optimizer.param_groups for p in group["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(opt_params)]
        else:
            named = list(named_parameters)
            for item in named:
                if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                    raise TypeError("DistributedOptimizer: named_parameters must yield (name, tensor) pairs, "
                                    "e.g. model.named_parameters()")
            names = [n for n, _ in named]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"DistributedOptimizer: parameter names are not unique: {dup}")
            listed = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(opt_params) if id(p) not in listed]
            if missing:
                raise ValueError(f"DistributedOptimizer: the optimizer's parameters at positions {missing} are not in "
                                 "named_parameters; pass every parameter the optimizer updates")

        # Share the wrapped optimizer's groups and state, and get the hook machinery
        # of torch.optim.Optimizer for the wrapper itself.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._optimizer = optimizer
        self._alias()

        self.compression = compression if isinstance(compression, str) else compression.name
        self.compressor = (compression if isinstance(compression, _compression.Compressor)
                           else _compression.by_name(compression))
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.algorithm = algorithm
        self.group = group
        self._group_size = size() if group is None else group.size
        self._member = group is None or group.is_member  # outside the group: local gradients, no reduction
        self.sparse_as_dense = bool(sparse_as_dense)
        self._sparse: Dict[int, object] = {}  # id(p) -> the sparse reduction in flight (sparse_as_dense=False)
        self.num_allreduces = 0
        self.bytes_reduced = 0
        self.bytes_sent = 0

        in_opt = {id(p) for p in opt_params}
        self._names: Dict[int, str] = {}
        trainable: List[torch.Tensor] = []
        seen = set()
        for name, p in named:
            if id(p) in seen or id(p) not in in_opt or not p.requires_grad:
                continue
            seen.add(id(p))
            collectives.check_tensor(p, "DistributedOptimizer", name)
            self._names[id(p)] = name
            trainable.append(p)
        if not isinstance(self.compressor, _compression.NoCompression):
            exact = sorted({str(p.dtype).replace("torch.", "") for p in trainable
                            if not self.compressor.supports(p.dtype)})
            if exact:  # said once, here: those buckets keep their full precision on the wire
                warnings.warn(f"pycomm.DistributedOptimizer(compression={self.compression!r}): parameters of dtype "
                              f"{', '.join(exact)} are reduced uncompressed; the compression applies to "
                              f"{self.compression!r}'s dtypes (float32)", UserWarning, stacklevel=2)

        # Buckets in reverse registration order, cut by size and dtype only.
        cap = int(bucket_mb * (1 << 20))
        self._buckets: List[_Bucket] = []
        current: List[torch.Tensor] = []
        current_bytes = 0
        for p in reversed(trainable):
            nbytes = p.numel() * p.element_size()
            if current and (current_bytes + nbytes > cap or p.dtype != current[0].dtype):
                self._buckets.append(_Bucket(len(self._buckets), current))
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += nbytes
        if current:
            self._buckets.append(_Bucket(len(self._buckets), current))
        self._bucket_of: Dict[int, _Bucket] = {id(p): b for b in self._buckets for p in b.params}
        for b in self._buckets:  # per-tensor compressors (powersgd) need the shapes inside a bucket
            if self._compressed(b):
                self.compressor.set_layout(f"DistributedOptimizer.bucket{b.index}", [tuple(p.shape) for p in b.params])
        self._passes: Dict[int, int] = {id(p): 0 for p in trainable}
        self._next_to_start = 0
        # True from synchronize() until the next gradient arrives or step()/zero_grad() ends the
        # iteration: step() then does not reduce again (Horovod: synchronize(); clip; step()).
        self._synchronized = False
        self._skip_sync = False
        # The hooks hold the wrapper weakly: a dropped DistributedOptimizer stops reducing.
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = ref()
            if opt is not None:
                opt._on_grad(p)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in trainable]

    # -- wiring ----------------------------------------------------------
    def _alias(self) -> None:
        self.param_groups = self._optimizer.param_groups
        self.state = self._optimizer.state
        self.defaults = self._optimizer.defaults

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped (local) optimizer."""
        return self._optimizer

    @property
    def buckets(self) -> List[List[str]]:
        """Parameter names per bucket, in the order buckets are reduced."""
        return [[self._names[id(p)] for p in b.params] for b in self._buckets]

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the wrapper then reduces only in step())."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- during backward ---------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._member:
            return
        key = id(p)
        self._synchronized = False
        self._passes[key] += 1
        passes = self._passes[key]
        if passes > self.backward_passes_per_step:
            raise RuntimeError(
                f"DistributedOptimizer: gradient of '{self._names[key]}' was computed {passes} times before step(); "
                f"backward_passes_per_step is {self.backward_passes_per_step}. Call step() after every "
                f"{self.backward_passes_per_step} backward pass(es), or raise backward_passes_per_step")
        if passes == self.backward_passes_per_step:
            bucket = self._bucket_of[key]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        while self._next_to_start < len(self._buckets):
            b = self._buckets[self._next_to_start]
            if b.ready < len(b.params):
                return
            self._start(b)
            self._next_to_start += 1

    def _start(self, b: _Bucket) -> None:
        if b.buffer is None or b.buffer.device != b.params[0].device:
            b.buffer = torch.empty(b.numel, dtype=b.dtype, device=b.params[0].device)
        offset = 0
        with torch.no_grad():
            for p in b.params:
                n = p.numel()
                view = b.buffer[offset:offset + n]
                if p.grad is None:
                    view.zero_()
                elif p.grad.is_sparse:
                    if self.sparse_as_dense:
                        view.copy_(p.grad.to_dense().reshape(-1))
                    else:  # reduced on its own (_start_sparse); its place in the bucket stays zero
                        view.zero_()
                        self._start_sparse(p)
                else:
                    view.copy_(p.grad.reshape(-1))
                offset += n
        name = f"DistributedOptimizer.bucket{b.index}"
        nbytes = b.numel * b.buffer.element_size()
        if self._compressed(b):
            # A CUDA bucket is compressed on its device (the engine's device paths): only the
            # compressed bytes leave the GPU.
            b.handle = self.compressor.allreduce_async(b.buffer, op=self.op, name=name)
            self.bytes_sent += self.compressor.wire_bytes_named(name, b.numel, size(), rank())
        else:
            b.handle = collectives.allreduce_async(b.buffer, op=self.op, algorithm=self.algorithm, name=name,
                                                   group=self.group)
            self.bytes_sent += ring_bytes_sent(nbytes, self._group_size)
        self.num_allreduces += 1
        self.bytes_reduced += nbytes

    def _start_sparse(self, p: torch.Tensor) -> None:
        """Allgather a sparse gradient's indices (as rows) and values over the group."""
        g = p.grad
        name = f"DistributedOptimizer.sparse.{self._names[id(p)]}"
        hi = collectives.allgather_async(g._indices().t().contiguous(), name=name + ".indices", group=self.group)
        hv = collectives.allgather_async(g._values().contiguous(), name=name + ".values", group=self.group)
        self._sparse[id(p)] = (hi, hv)
        self.num_allreduces += 2

    def _finish_sparse(self, p: torch.Tensor) -> None:
        hi, hv = self._sparse.pop(id(p))
        values = hv.wait()
        if self.op == "avg":
            values = values / self._group_size
        p.grad = torch.sparse_coo_tensor(hi.wait().t(), values, p.shape)

    def _compressed(self, b: _Bucket) -> bool:
        return not isinstance(self.compressor, _compression.NoCompression) and self.compressor.supports(b.dtype)

    # -- step --------------------------------------------------------------
    @profiled("pycomm.DistributedOptimizer.synchronize")
    def synchronize(self) -> None:
        """Start the buckets not yet started, wait for all, write reduced gradients to ``p.grad``.

        Idempotent within an iteration: after one synchronize(), another one (or
        step()) does not reduce again until a new backward pass produces gradients.
        """
        if self._synchronized or not self._member:
            return
        while self._next_to_start < len(self._buckets):
            self._start(self._buckets[self._next_to_start])
            self._next_to_start += 1
        with torch.no_grad():
            for b in self._buckets:
                b.handle.wait()
                offset = 0
                for p in b.params:
                    n = p.numel()
                    view = b.buffer[offset:offset + n].view_as(p)
                    if id(p) in self._sparse:
                        self._finish_sparse(p)
                    elif p.grad is None:
                        p.grad = view.clone()
                    elif p.grad.is_sparse:  # sparse_as_dense: sparse again for the optimizer
                        p.grad = view.to_sparse()
                    else:
                        p.grad.copy_(view)
                    offset += n
                b.handle = None
                b.ready = 0
        for key in self._passes:
            self._passes[key] = 0
        self._next_to_start = 0
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this context ``step()`` does not reduce: call ``synchronize()`` before it.

        Horovod's pattern for working on the reduced gradients before the update::

            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # or scaler.unscale_(opt)
            with opt.skip_synchronize():
                opt.step()                                             # or scaler.step(opt)

        (Without the context, ``step()`` after ``synchronize()`` also reduces only once.)
        """
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def join(self) -> int:
        """This rank has run out of batches: take part in the other ranks' gradient reductions until all have.

        ``pycomm.join()`` (Horovod's semantics): while other ranks still step,
        this rank contributes zero gradients and is counted out of their
        average, so each of their steps averages over the ranks that had a
        batch. When every rank has joined, every rank takes the parameters and
        optimizer state of the rank that joined last (it took every step), so
        the ranks agree again. Returns that rank. Compressed buckets cannot be
        answered by a joined rank (pycomm.CommError on every rank): use
        compression="none" with uneven data.
        """
        if self._next_to_start > 0 or any(b.ready for b in self._buckets):
            raise ValueError(f"DistributedOptimizer.join (rank {rank()}): this rank's gradients of the current "
                             "iteration are not reduced yet; call step() (or synchronize()) before join()")
        last = _join()
        params = [p for g in self.param_groups for p in g["params"]]
        broadcast_parameters(params, root=last)
        broadcast_optimizer_state(self._optimizer, root=last)
        return last

    def step(self, closure=None):
        """Reduce the gradients over all ranks (unless synchronize() already did), then step the wrapped optimizer.

        A closure is evaluated first (its backward pass fills the buckets).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._skip_sync:
            if not self._synchronized and (self._next_to_start > 0 or any(b.ready for b in self._buckets)):
                raise RuntimeError(
                    f"DistributedOptimizer (rank {rank()}): step() inside skip_synchronize() but the gradients of this "
                    "iteration were not reduced; call opt.synchronize() before the skip_synchronize() block")
        else:
            self.synchronize()
        self._optimizer.step()
        self._synchronized = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(b.handle is not None for b in self._buckets):
            raise RuntimeError("DistributedOptimizer.zero_grad() called while gradients are being reduced; "
                               "call step() (or synchronize()) first")
        self._synchronized = False
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state_dict, plus this rank's compression state (error-feedback residuals)."""
        sd = self._optimizer.state_dict()
        sd["pycomm_compression"] = self.compressor.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        comp = state_dict.pop("pycomm_compression", None)
        self._optimizer.load_state_dict(state_dict)
        self._alias()
        if comp is not None:
            self.compressor.load_state_dict(comp)

    def reset_after_failure(self) -> None:
        """Forget the reductions of an iteration that a rank's death interrupted (pycomm.elastic): their
        handles failed with RanksFailedError, and the job now has fewer ranks. The gradients of that
        iteration are dropped; training goes on from restored state. A process group was made again with
        its surviving ranks (pycomm.groups.rebuild), so the averaging follows its new size."""
        for b in self._buckets:
            b.handle = None
            b.ready = 0
        self._sparse.clear()
        for key in self._passes:
            self._passes[key] = 0
        self._next_to_start = 0
        self._synchronized = False
        self._group_size = size() if self.group is None else self.group.size

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_optimizer"):
            raise RuntimeError("DistributedOptimizer: add parameter groups to the optimizer before wrapping it")
        super().add_param_group(param_group)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r}, buckets={len(self._buckets)}, op={self.op!r})"


# -- broadcasts ----------------------------------------------------------------

_BCAST_CAST = {torch.bool: torch.int32, torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32}


def _named_tensors(params) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, dict):
        return sorted(params.items(), key=lambda kv: str(kv[0]))
    out = []
    for i, item in enumerate(params):
        if isinstance(item, tuple) and len(item) == 2:
            out.append((str(item[0]), item[1]))
        elif isinstance(item, torch.Tensor):
            out.append((f"tensor.{i}", item))
        else:
            raise TypeError("broadcast_parameters: expected a state_dict, (name, tensor) pairs or tensors, "
                            f"got an element of type {type(item).__name__}")
    return out


def broadcast_parameters(params: Union[dict, Iterable], root: int = 0) -> None:
    """Overwrite every rank's tensors with root's, in place.

    params: a state_dict (taken in sorted key order), ``model.named_parameters()``
    or a list of tensors, given in the same order on every rank. Tensors are
    flattened into one buffer per dtype, so the whole model costs one
    broadcast per dtype.
    """
    named = [(n, t) for n, t in _named_tensors(params) if isinstance(t, torch.Tensor)]
    groups: "OrderedDict[Tuple[torch.dtype, torch.device], List[torch.Tensor]]" = OrderedDict()
    for _, t in named:
        wire = _BCAST_CAST.get(t.dtype, t.dtype)
        groups.setdefault((wire, t.device), []).append(t)
    with torch.no_grad():
        for (wire, device), tensors in groups.items():
            flat = torch.cat([t.detach().reshape(-1).to(wire) for t in tensors]) if tensors else None
            if flat is None or flat.numel() == 0:
                continue
            collectives.broadcast(flat, root=root, name="broadcast_parameters")
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t).to(t.dtype))
                offset += n


def broadcast_object(obj, root: int = 0):
    """Return root's `obj` on every rank (serialized with torch.save, sent with pycomm.broadcast)."""
    from .runtime import rank

    if rank() == root:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = bytearray(buf.getvalue())
    else:
        data = bytearray()
    length = torch.tensor([len(data)], dtype=torch.int64)
    collectives.broadcast(length, root=root, name="broadcast_object.length")
    n = int(length.item())
    padded = (n + 3) // 4 * 4
    payload = torch.zeros(padded // 4, dtype=torch.int32)
    if rank() == root:
        data.extend(b"\0" * (padded - n))
        payload = torch.frombuffer(data, dtype=torch.int32).clone() if padded else payload
    if padded:
        collectives.broadcast(payload, root=root, name="broadcast_object.payload")
    if rank() == root:
        return obj
    raw = payload.numpy().tobytes()[:n]
    return torch.load(io.BytesIO(raw), weights_only=False)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0) -> None:
    """Give every rank root's optimizer state (hyperparameters and per-parameter buffers).

    Root's ``state_dict()`` is serialized and broadcast, and loaded on the other
    ranks; parameters are matched by position, so build the optimizer the same
    way on every rank. Works before the first step too (empty state).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    from .runtime import rank

    mine = optimizer.state_dict() if rank() == root else None
    if mine is not None:  # error-feedback residuals are per rank: every rank keeps its own
        mine = {k: v for k, v in mine.items() if k != "pycomm_compression"}
    state = broadcast_object(mine, root=root)
    if rank() != root:
        optimizer.load_state_dict(state)


__all__ = ["DistributedOptimizer", "SUPPORTED_COMPRESSION", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters", "check_compression", "ring_bytes_sent"]
