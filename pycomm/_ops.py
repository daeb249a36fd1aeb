"""The checked calls into the engine that both collectives.py and compression.py use.

Imports go one way: ``collectives`` -> ``compression`` -> ``_ops`` -> ``_C``.
Everything a tensor must satisfy is checked here, before anything reaches the
engine, so bad input fails on the calling rank with a TypeError/ValueError
that names the problem.
"""
from __future__ import annotations

import threading
import warnings
from typing import List, Optional

import torch

from . import _C
from .runtime import topology

# The dtypes the engine moves: the table in csrc/kernels/dtype.h, read through _C (one place decides).
# Integers wrap around; bool reduces as logical or (sum, max) and logical and (min, prod).
SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in _C.dtype_names)
REDUCE_OPS = ("sum", "avg", "min", "max")
#: op -> the engine's (reduction, average): avg is a sum followed by a division by the number of ranks,
#: which the engine places (half precision divides before summing, so the sum cannot overflow).
ENGINE_OP = {op: ("sum", True) if op == "avg" else (op, False) for op in REDUCE_OPS}
#: "auto" and the allreduce catalogue's algorithms (csrc/comm/allreduce_catalogue.cpp), in wire order.
ALLREDUCE_ALGORITHMS = ("auto",) + tuple(entry["name"] for entry in _C.allreduce_algorithms())


def label(name: Optional[str]) -> str:
    return f" '{name}'" if name else ""


def check_tensor(tensor, what: str, name: Optional[str] = None) -> None:
    """Raise TypeError/ValueError unless `tensor` is something the engine can move."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pycomm.{what}: expected a torch.Tensor{label(name)}, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"pycomm.{what}: tensor{label(name)} has unsupported dtype "
                        f"{str(tensor.dtype).replace('torch.', '')}; supported: {supported}")
    if tensor.device.type == "cuda":
        if not _C.cuda_built:
            raise ValueError(f"pycomm.{what}: tensor{label(name)} is on {tensor.device} but this pycomm was built "
                             "without CUDA; reinstall with a CUDA build of torch (PYCOMM_CUDA=1)")
    elif tensor.device.type != "cpu":
        raise ValueError(f"pycomm.{what}: tensor{label(name)} is on {tensor.device}; pycomm handles cpu and cuda")
    if not tensor.is_contiguous():
        raise ValueError(f"pycomm.{what}: tensor{label(name)} is not contiguous (strides {tuple(tensor.stride())}); "
                         "pass tensor.contiguous()")


def check_op(op: str, dtype: torch.dtype, what: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"pycomm.{what}: unknown op {op!r}; choose one of {', '.join(REDUCE_OPS)}")
    if op == "avg" and not dtype.is_floating_point:
        raise TypeError(f"pycomm.{what}: op='avg' needs a floating-point tensor, got "
                        f"{str(dtype).replace('torch.', '')}; use op='sum' and divide yourself")


def check_out(tensor: torch.Tensor, out: Optional[torch.Tensor], name: Optional[str]) -> torch.Tensor:
    if out is None:
        return tensor
    check_tensor(out, "allreduce (out)", name)
    if out.shape != tensor.shape or out.dtype != tensor.dtype or out.device != tensor.device:
        raise ValueError(f"pycomm.allreduce: out{label(name)} is {out.dtype}{list(out.shape)} on {out.device}, "
                         f"expected {tensor.dtype}{list(tensor.shape)} on {tensor.device}")
    return out


class _Unnamed:
    """Unnamed asynchronous allreduces still in flight, to warn once about order matching."""

    lock = threading.Lock()
    pending: List = []
    warned = False


UNNAMED_WARNING = (
    "pycomm.allreduce_async: several unnamed asynchronous allreduces are in flight. Ranks pair operations by "
    "submission order alone, so every rank must submit them in the same order; unnamed tensors of the same "
    "shape queued in different orders are silently paired across tensors. Pass name= (as DistributedOptimizer "
    "and the DDP hooks do) and a different order raises CommError on every rank instead.")


def note_unnamed(handle, stacklevel: int = 4) -> None:
    if _Unnamed.warned:  # once warned, nothing more to track (read without the lock: it only turns True)
        return
    with _Unnamed.lock:
        _Unnamed.pending = [h for h in _Unnamed.pending if not h.done()]
        if _Unnamed.pending and not _Unnamed.warned:
            _Unnamed.warned = True
            warnings.warn(UNNAMED_WARNING, UserWarning, stacklevel=stacklevel)
        if not _Unnamed.warned:
            _Unnamed.pending.append(handle)


def check_allreduce(tensor: torch.Tensor, op: str, algorithm: str, out: Optional[torch.Tensor],
                    name: Optional[str]) -> torch.Tensor:
    """Every check of an allreduce call; returns the output tensor."""
    topology()
    check_tensor(tensor, "allreduce", name)
    check_op(op, tensor.dtype, "allreduce")
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"pycomm.allreduce: unknown algorithm {algorithm!r}; "
                         f"choose one of {', '.join(ALLREDUCE_ALGORITHMS)}")
    return check_out(tensor, out, name)


def allreduce_async(tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto",
                    out: Optional[torch.Tensor] = None, name: Optional[str] = None, blocking: bool = False,
                    gid: int = 0, stacklevel: int = 4):
    """The uncompressed allreduce: checks, then the engine (gid: a pycomm.groups id, 0 for all ranks).
    stacklevel: the unnamed-handle warning's, naming the user's line."""
    out = check_allreduce(tensor, op, algorithm, out, name)
    handle = _C.allreduce_async(tensor, out, *ENGINE_OP[op], algorithm, name or "", blocking, gid)
    if not blocking and not name:
        note_unnamed(handle, stacklevel)
    return handle


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, gid: int = 0):
    topology()
    check_tensor(tensor, "allgather", name)
    if tensor.dim() == 0:
        raise ValueError(f"pycomm.allgather: tensor{label(name)} is a scalar; give it at least one dimension "
                         "(tensor.reshape(1))")
    return _C.allgather_async(tensor, name or "", gid)
