"""Collectives on torch tensors: allreduce, broadcast, allgather, barrier.

Every call is checked here, before anything reaches the engine, so bad input
fails on the calling rank with a TypeError/ValueError that names the problem.
Calls then run on the engine's background thread in submission order; the
synchronous forms submit and wait with the GIL released. After an allreduce
every rank holds bitwise the same values.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import _C, _ops
from ._ops import ALLREDUCE_ALGORITHMS, ENGINE_OP, REDUCE_OPS, SUPPORTED_DTYPES, check_tensor  # noqa: F401 (public names)
from ._ops import check_op as _check_op
from ._ops import label as _label
from .compression import Compressor, resolve
from .groups import ProcessGroup, group_id, group_rank, group_size
from .runtime import _state, topology
from .timeline import _profiler_enabled, profiled

Handle = _C.Handle
GroupHandle = _C.GroupHandle

# The engine's compressions, from its table (csrc/comm/compressed_allreduce.cpp); more in Python through
# pycomm.compression.register().
COMPRESSIONS = ("none", *_C.engine_compressions())

# (op, dtype) pairs allreduce accepts (check_op) and its algorithms: the fast paths' checks are set lookups.
_VALID_OP_DTYPES = frozenset((op, dtype) for op in REDUCE_OPS for dtype in SUPPORTED_DTYPES
                             if op != "avg" or dtype.is_floating_point)
_ALGORITHMS = frozenset(ALLREDUCE_ALGORITHMS)


_ALLREDUCE_ASYNC_DEFAULTS = dict(op="sum", algorithm="auto", out=None, name=None, _blocking=False,
                                 compression="none", group=None)
_ALLREDUCE_ASYNC_DOC = """allreduce_async(tensor, op='sum', algorithm='auto', out=None, name=None, _blocking=False, \
compression='none', group=None)
--

Start an allreduce; ``handle.wait()`` returns the result tensor.

op: sum | avg | min | max. avg of fp16/bf16 divides by N before summing
(a sum of large fp16 values overflows before a later division could help).
algorithm: auto (by size and topology, see ``pycomm.resolve_algorithm``) |
ring (pycomm's pipelined ring) | mpi (MPI_Allreduce) | shm (one node,
through shared memory) | hierarchical (intra-node reduce-scatter, one
inter-node ring per local rank, intra-node allgather) |
hierarchical_master (reduce to each node's rank 0, ring among those,
broadcast back).
out: result tensor of the same shape and dtype; None reduces in place.
compression: none | fp16 | bf16 | onebit (float32 tensors, op avg or sum,
algorithm auto; onebit needs a name) or a pycomm.compression.Compressor;
see pycomm.compression.
group: a pycomm.new_group() group (default: all ranks).
"""


def _checked_allreduce_async(tensor, op, algorithm, out, name, blocking, compression, group) -> Handle:
    """Every call that allreduce_async's C entry (below) does not take: the full checks, their messages,
    compression and groups. Entered once per call (allreduce() comes here straight from its own fast test)."""
    topology()
    gid = group_id(group, "allreduce")
    if not (isinstance(compression, str) and compression == "none"):
        out = _ops.check_allreduce(tensor, op, algorithm, out, name)
        compressor = resolve(compression)
        if compressor.name != "none":
            if gid:
                raise ValueError("pycomm.allreduce: compression runs over all ranks; group= needs compression='none'")
            if algorithm != "auto":
                raise ValueError(f"pycomm.allreduce: algorithm={algorithm!r} applies to compression='none'; "
                                 f"compression={compressor.name!r} runs its own scheme (leave algorithm='auto')")
            handle = compressor.allreduce_async(tensor, op=op, name=name, out=out, _blocking=blocking)
            if not blocking and not name:
                _ops.note_unnamed(handle, stacklevel=3)
            return handle
    return _ops.allreduce_async(tensor, op=op, algorithm=algorithm, out=out, name=name, blocking=blocking, gid=gid,
                                stacklevel=4)


# The common call (in place, all ranks, uncompressed, a tensor the engine takes) goes from this C
# function straight to the engine's submission, which checks the tensor (dtype, device, layout,
# strides) and the algorithm before it queues anything; every other call, and any call the
# submission refuses, goes to _checked_allreduce_async with all eight arguments
# (csrc/bindings/allreduce_entry.cpp; bench/submit_cost.py times it).
allreduce_async = _C.allreduce_entry(_checked_allreduce_async, _ops.note_unnamed, ENGINE_OP,
                                     _ALLREDUCE_ASYNC_DEFAULTS, __name__, _ALLREDUCE_ASYNC_DOC)


@profiled("pycomm.allreduce")
def _allreduce(tensor, op, algorithm, out, name, compression, group):
    return _checked_allreduce_async(tensor, op, algorithm, out, name, True, compression, group).wait()


def allreduce(tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto",
              out: Optional[torch.Tensor] = None, name: Optional[str] = None,
              compression: Union[str, Compressor] = "none", group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Reduce `tensor` over all ranks; see allreduce_async. Returns the result."""
    # The common call (in place, all ranks, uncompressed, a contiguous CPU tensor, no torch profiler)
    # passes the same checks as allreduce_async's, as set lookups, and goes to the engine with no
    # Handle (bench/latency.py); anything else, valid or not, takes the checked path and its messages.
    if (out is None and group is None and type(tensor) is torch.Tensor and compression.__class__ is str
            and compression == "none" and _state.topology is not None and op.__class__ is str
            and (op, tensor.dtype) in _VALID_OP_DTYPES and algorithm.__class__ is str and algorithm in _ALGORITHMS
            and tensor.is_cpu and tensor.is_contiguous() and not _profiler_enabled()):
        return _C.allreduce_blocking(tensor, *ENGINE_OP[op], algorithm, name or "")
    return _allreduce(tensor, op, algorithm, out, name, compression, group)


class HandleList:
    """Handles of a grouped allreduce taken one tensor at a time (compressed groups): the interface of
    GroupHandle (wait() and synchronize() return the list of results)."""

    def __init__(self, handles):
        self._handles = list(handles)

    def _finish(self, how: str) -> list:
        results, first = [], None
        for h in self._handles:  # every handle is waited for before an error is raised, as GroupHandle does
            try:
                results.append(getattr(h, how)() if hasattr(h, how) else h.wait())
            except Exception as e:  # noqa: BLE001 (re-raised below)
                first = first or e
        if first is not None:
            raise first
        return results

    def wait(self) -> list:
        return self._finish("wait")

    def synchronize(self) -> list:
        return self._finish("synchronize")

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def __len__(self) -> int:
        return len(self._handles)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], op: str = "sum", algorithm: str = "auto",
                            outs: Optional[Sequence[torch.Tensor]] = None, name: Optional[str] = None,
                            compression: Union[str, Compressor] = "none",
                            group: Optional[ProcessGroup] = None, _blocking: bool = False):
    """Start the allreduces of every tensor of `tensors` in one call; ``wait()`` returns the list of results.

    The tensors go to the engine in one submission, in list order, instead of one Python call each,
    and fuse as consecutive allreduces do (same dtype, op and device, up to PYCOMM_FUSION_THRESHOLD
    bytes and 1024 tensors a batch): many small tensors cost about one allreduce of their total
    (bench/fusion.py). Horovod's ``hvd.grouped_allreduce``. op, algorithm, compression and group
    apply to every tensor, as in allreduce_async; outs: one result tensor per input (None: in place);
    name: tensor i is named ``f"{name}.{i}"`` (compression="onebit" needs a name). Every rank must
    pass the same list (length, dtypes, shapes), as for single allreduces.
    """
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"pycomm.grouped_allreduce: expected a list or tuple of tensors, got {type(tensors).__name__}")
    if outs is not None and (not isinstance(outs, (list, tuple)) or len(outs) != len(tensors)):
        raise ValueError(f"pycomm.grouped_allreduce: outs must be a list of {len(tensors)} tensors, one per input")
    names = [f"{name}.{i}" for i in range(len(tensors))] if name else []
    if not (isinstance(compression, str) and compression == "none"):
        return HandleList(allreduce_async(t, op=op, algorithm=algorithm, out=None if outs is None else outs[i],
                                          name=names[i] if names else None, compression=compression, group=group,
                                          _blocking=_blocking) for i, t in enumerate(tensors))
    topology()
    gid = group_id(group, "grouped_allreduce")
    # The common group (CPU tensors, ops and dtypes allreduce accepts) is checked with set lookups;
    # anything else is checked tensor by tensor with allreduce's messages, naming the tensor.
    fast = (outs is None and op.__class__ is str and algorithm.__class__ is str and algorithm in _ALGORITHMS
            and all(type(t) is torch.Tensor and (op, t.dtype) in _VALID_OP_DTYPES and t.is_cpu and t.is_contiguous()
                    for t in tensors))
    if not fast:
        outs = [_ops.check_allreduce(t, op, algorithm, None if outs is None else outs[i],
                                     names[i] if names else f"tensors[{i}]") for i, t in enumerate(tensors)]
    handle = _C.grouped_allreduce_async(list(tensors), list(tensors) if outs is None else list(outs),
                                        *ENGINE_OP[op], algorithm, names, _blocking, gid)
    if not _blocking and not name and len(tensors) > 1:
        _ops.note_unnamed(handle, stacklevel=3)
    return handle


@profiled("pycomm.grouped_allreduce")
def grouped_allreduce(tensors: Sequence[torch.Tensor], op: str = "sum", algorithm: str = "auto",
                      outs: Optional[Sequence[torch.Tensor]] = None, name: Optional[str] = None,
                      compression: Union[str, Compressor] = "none",
                      group: Optional[ProcessGroup] = None) -> list:
    """Reduce every tensor of `tensors` over all ranks in one submission; returns the list of results.
    See grouped_allreduce_async."""
    return grouped_allreduce_async(tensors, op=op, algorithm=algorithm, outs=outs, name=name, compression=compression,
                                   group=group, _blocking=True).wait()


def broadcast_async(tensor: torch.Tensor, root: int = 0, name: Optional[str] = None,
                    _blocking: bool = False, group: Optional[ProcessGroup] = None) -> Handle:
    """Start a broadcast of `tensor` from `root` (a rank of `group`) into every rank's `tensor` (in place)."""
    topology()
    gid, n = group_id(group, "broadcast"), group_size(group)
    check_tensor(tensor, "broadcast", name)
    if not isinstance(root, int) or not 0 <= root < n:
        raise ValueError(f"pycomm.broadcast: root={root!r} is not a rank of this {'group' if gid else 'job'} "
                         f"(0..{n - 1})")
    return _C.broadcast_async(tensor, root, name or "", _blocking, gid)


@profiled("pycomm.broadcast")
def broadcast(tensor: torch.Tensor, root: int = 0, name: Optional[str] = None,
              group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Broadcast `tensor` from `root` in place; returns it."""
    return broadcast_async(tensor, root, name, _blocking=True, group=group).wait()


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, group: Optional[ProcessGroup] = None) -> Handle:
    """Start an allgather; ``wait()`` returns the concatenation along dim 0 in rank order.

    The first dimension may differ per rank; the others, and the dtype, must agree.
    """
    topology()
    return _ops.allgather_async(tensor, name, gid=group_id(group, "allgather"))


@profiled("pycomm.allgather")
def allgather(tensor: torch.Tensor, name: Optional[str] = None, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dim 0, in rank order."""
    return allgather_async(tensor, name, group=group).wait()


def resolve_algorithm(algorithm: str, nbytes: int) -> str:
    """The algorithm `algorithm` stands for with a message of `nbytes` on this job's topology."""
    topology()
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALLREDUCE_ALGORITHMS)}")
    return _C.resolve_algorithm(algorithm, int(nbytes))


@profiled("pycomm.barrier")
def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Block until every rank has reached the barrier (after all earlier collectives)."""
    topology()
    _C.barrier_async(True, group_id(group, "barrier")).wait()


REDUCE_SCATTER_ALGORITHMS = ("auto", "ring", "mpi")


def reduce_scatter_async(tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto",
                         name: Optional[str] = None, group: Optional[ProcessGroup] = None,
                         _blocking: bool = False) -> Handle:
    """Start a reduce-scatter; ``wait()`` returns this rank's part of the reduction.

    `tensor` is cut along dim 0 into N parts as ``torch.tensor_split(tensor, N)``
    does (sizes differ by at most one row, the first parts larger); rank r
    receives the reduction (op: sum | avg | min | max) of part r over all ranks.
    `tensor` is not modified. algorithm: auto (mpi below PYCOMM_AUTO_RING_MIN_BYTES,
    else ring) | ring (the reduce-scatter half of the ring allreduce) | mpi
    (MPI_Reduce_scatter).
    """
    topology()
    gid, n, r = group_id(group, "reduce_scatter"), group_size(group), group_rank(group)
    check_tensor(tensor, "reduce_scatter", name)
    _check_op(op, tensor.dtype, "reduce_scatter")
    if algorithm not in REDUCE_SCATTER_ALGORITHMS:
        raise ValueError(f"pycomm.reduce_scatter: unknown algorithm {algorithm!r}; "
                         f"choose one of {', '.join(REDUCE_SCATTER_ALGORITHMS)}")
    if tensor.dim() == 0:
        raise ValueError(f"pycomm.reduce_scatter: tensor{_label(name)} is a scalar; give it at least one dimension")
    base, rem = divmod(tensor.shape[0], n)
    rows = [base + (1 if i < rem else 0) for i in range(n)]
    out = torch.empty((rows[r],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    return _C.reduce_scatter_async(tensor, out, rows, *ENGINE_OP[op], algorithm, name or "", _blocking, gid)


@profiled("pycomm.reduce_scatter")
def reduce_scatter(tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", name: Optional[str] = None,
                   group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """This rank's part of the reduction of `tensor` over all ranks; see reduce_scatter_async."""
    return reduce_scatter_async(tensor, op, algorithm, name, group, _blocking=True).wait()


def alltoall_async(tensor: torch.Tensor, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
                   group: Optional[ProcessGroup] = None, _blocking: bool = False) -> Handle:
    """Start an alltoall; ``wait()`` returns the rows received from every rank, in rank order.

    splits[j] rows of `tensor` (dim 0, in order) go to rank j; None sends equal
    parts (the first dimension must then be divisible by the number of ranks).
    Ranks may send different numbers of rows; the other dimensions and the
    dtype must agree.
    """
    topology()
    gid, n = group_id(group, "alltoall"), group_size(group)
    check_tensor(tensor, "alltoall", name)
    if tensor.dim() == 0:
        raise ValueError(f"pycomm.alltoall: tensor{_label(name)} is a scalar; give it at least one dimension")
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"pycomm.alltoall: tensor{_label(name)} has {tensor.shape[0]} rows, not divisible by "
                             f"{n} ranks; pass splits=[rows for each rank]")
        splits = [tensor.shape[0] // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != tensor.shape[0]:
        raise ValueError(f"pycomm.alltoall: splits {splits} must be {n} non-negative row counts adding up to "
                         f"the tensor's {tensor.shape[0]} rows")
    return _C.alltoall_async(tensor, splits, name or "", _blocking, gid)


@profiled("pycomm.alltoall")
def alltoall(tensor: torch.Tensor, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Send splits[j] rows of `tensor` to rank j; return the rows received, in rank order."""
    return alltoall_async(tensor, splits, name, group, _blocking=True).wait()
