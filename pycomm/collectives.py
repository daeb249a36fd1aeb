"""Collectives on torch tensors: allreduce, broadcast, allgather, barrier.

Every call is checked here, before anything reaches the engine, so bad input
fails on the calling rank with a TypeError/ValueError that names the problem.
Calls then run on the engine's background thread in submission order; the
synchronous forms submit and wait with the GIL released. After an allreduce
every rank holds bitwise the same values.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import _C, _ops
from ._ops import ALLREDUCE_ALGORITHMS, REDUCE_OPS, SUPPORTED_DTYPES, check_tensor  # noqa: F401 (public names)
from .compression import Compressor, resolve
from .runtime import topology

Handle = _C.Handle

COMPRESSIONS = ("none", "fp16", "bf16", "onebit")  # pycomm/compression.py; more via compression.register()


def allreduce_async(tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto",
                    out: Optional[torch.Tensor] = None, name: Optional[str] = None, _blocking: bool = False,
                    compression: Union[str, Compressor] = "none") -> Handle:
    """Start an allreduce; ``handle.wait()`` returns the result tensor.

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
    """
    if not (isinstance(compression, str) and compression == "none"):
        out = _ops.check_allreduce(tensor, op, algorithm, out, name)
        compressor = resolve(compression)
        if compressor.name != "none":
            if algorithm != "auto":
                raise ValueError(f"pycomm.allreduce: algorithm={algorithm!r} applies to compression='none'; "
                                 f"compression={compressor.name!r} runs its own scheme (leave algorithm='auto')")
            handle = compressor.allreduce_async(tensor, op=op, name=name, out=out, _blocking=_blocking)
            if not _blocking and not name:
                _ops.note_unnamed(handle, stacklevel=3)
            return handle
    return _ops.allreduce_async(tensor, op=op, algorithm=algorithm, out=out, name=name, blocking=_blocking)


def allreduce(tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto",
              out: Optional[torch.Tensor] = None, name: Optional[str] = None,
              compression: Union[str, Compressor] = "none") -> torch.Tensor:
    """Reduce `tensor` over all ranks; see allreduce_async. Returns the result."""
    return allreduce_async(tensor, op=op, algorithm=algorithm, out=out, name=name, _blocking=True,
                           compression=compression).wait()


def broadcast_async(tensor: torch.Tensor, root: int = 0, name: Optional[str] = None,
                    _blocking: bool = False) -> Handle:
    """Start a broadcast of `tensor` from `root` into every rank's `tensor` (in place)."""
    topo = topology()
    _ops.check_tensor(tensor, "broadcast", name)
    if not isinstance(root, int) or not 0 <= root < topo.size:
        raise ValueError(f"pycomm.broadcast: root={root!r} is not a rank of this job (0..{topo.size - 1})")
    return _C.broadcast_async(tensor, root, name or "", _blocking)


def broadcast(tensor: torch.Tensor, root: int = 0, name: Optional[str] = None) -> torch.Tensor:
    """Broadcast `tensor` from `root` in place; returns it."""
    return broadcast_async(tensor, root, name, _blocking=True).wait()


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None) -> Handle:
    """Start an allgather; ``wait()`` returns the concatenation along dim 0 in rank order.

    The first dimension may differ per rank; the others, and the dtype, must agree.
    """
    return _ops.allgather_async(tensor, name)


def allgather(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dim 0, in rank order."""
    return allgather_async(tensor, name).wait()


def resolve_algorithm(algorithm: str, nbytes: int) -> str:
    """The algorithm `algorithm` stands for with a message of `nbytes` on this job's topology."""
    topology()
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALLREDUCE_ALGORITHMS)}")
    return _C.resolve_algorithm(algorithm, int(nbytes))


def barrier() -> None:
    """Block until every rank has reached the barrier (after all earlier collectives)."""
    topology()
    _C.barrier_async(True).wait()
