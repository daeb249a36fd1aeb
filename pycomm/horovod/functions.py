"""Horovod's helper functions (horovod.torch.functions): broadcasts of parameters, optimizer state and objects."""
from __future__ import annotations

import io

import torch

import pycomm

from .mpi_ops import _check_root, allgather, broadcast_, rank
from .process_sets import ProcessSet, global_process_set


def _is_global(process_set) -> bool:
    return process_set is None or process_set is global_process_set


def broadcast_parameters(params, root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's parameters with root's, in place.

    params: ``model.state_dict()``, ``model.named_parameters()`` or a list of
    (name, tensor) pairs, in the same order on every rank.
    """
    _check_root(root_rank, process_set, "broadcast_parameters")
    if _is_global(process_set):
        pycomm.broadcast_parameters(params, root=root_rank)
        return
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    with torch.no_grad():
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"broadcast_parameters: {name!r} is a {type(t).__name__}, not a tensor")
            flat = t.detach().contiguous()
            broadcast_(flat, root_rank, name=f"broadcast_parameters.{name}", process_set=process_set)
            if flat.data_ptr() != t.data_ptr():
                t.copy_(flat)


def broadcast_optimizer_state(optimizer, root_rank: int, model=None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every rank root's optimizer state (hyperparameters and buffers), matched by parameter position.

    As in Horovod, an optimizer without state yet (before its first step) gets it first: every parameter
    that requires a gradient and has none gets a zero gradient, and the local optimizer takes one step
    (collective-free, the same on every rank), so that buffers such as momentum exist and are broadcast.
    """
    _check_root(root_rank, process_set, "broadcast_optimizer_state")
    if not optimizer.state_dict()["state"]:
        local = optimizer.optimizer if isinstance(optimizer, pycomm.DistributedOptimizer) else optimizer
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    if isinstance(local, torch.optim.SparseAdam):
                        p.grad = p.grad.to_sparse()
        local.step()
    if _is_global(process_set):
        pycomm.broadcast_optimizer_state(optimizer, root=root_rank)
        return
    mine = optimizer.state_dict() if rank() == root_rank else None
    if mine is not None:
        mine = {k: v for k, v in mine.items() if k != "pycomm_compression"}  # residuals are per rank
    state = broadcast_object(mine, root_rank, process_set=process_set)
    if rank() != root_rank:
        optimizer.load_state_dict(state)


def _to_tensor(obj) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = bytearray(buf.getvalue())
    data.extend(b"\0" * (-len(data) % 4))
    return torch.frombuffer(data, dtype=torch.int32).clone(), len(buf.getvalue())


def _from_tensor(t: torch.Tensor, n: int):
    return torch.load(io.BytesIO(t.numpy().tobytes()[:n]), weights_only=False)


def broadcast_object(obj, root_rank: int = 0, name=None, process_set: ProcessSet = global_process_set):
    """Root's `obj` on every rank (serialized with torch.save)."""
    _check_root(root_rank, process_set, "broadcast_object")
    if _is_global(process_set):
        return pycomm.broadcast_object(obj, root=root_rank)
    name = name or type(obj).__name__
    root = rank() == root_rank
    payload, n = _to_tensor(obj) if root else (None, 0)
    length = torch.tensor([n, 0 if payload is None else payload.numel()], dtype=torch.int64)
    broadcast_(length, root_rank, name=f"broadcast_object.{name}.length", process_set=process_set)
    if not root:
        payload = torch.zeros(int(length[1]), dtype=torch.int32)
    if payload.numel():
        broadcast_(payload, root_rank, name=f"broadcast_object.{name}", process_set=process_set)
    return obj if root else _from_tensor(payload, int(length[0]))


def allgather_object(obj, name=None, process_set: ProcessSet = global_process_set) -> list:
    """Every rank's `obj`, as a list in rank order (serialized with torch.save)."""
    name = name or type(obj).__name__
    payload, n = _to_tensor(obj)
    lengths = allgather(torch.tensor([[n, payload.numel()]], dtype=torch.int64),
                        name=f"allgather_object.{name}.length", process_set=process_set)
    gathered = allgather(payload, name=f"allgather_object.{name}", process_set=process_set)
    out, offset = [], 0
    for nbytes, words in lengths.tolist():
        out.append(_from_tensor(gathered[offset:offset + words], nbytes))
        offset += words
    return out
