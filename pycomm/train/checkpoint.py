"""Per-rank checkpoints with an agreed ``latest`` marker.

Each rank writes ``step{S:09d}-rank{k}.pt`` (atomically: temp file, then
rename). When every rank has written step S (a barrier), rank 0 points
``latest`` at S. Resume reads ``latest``, so a job killed while writing
resumes from the last step that every rank completed. The two newest steps
are kept.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Any, Optional

import torch

import pycomm


def _path(directory: str, step: int, rank: int) -> str:
    return os.path.join(directory, f"step{step:09d}-rank{rank}.pt")


def _atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(directory: str, step: int, state: Any) -> str:
    """Collective: every rank saves its `state` for global step `step`."""
    rank = pycomm.rank()
    os.makedirs(directory, exist_ok=True)
    path = _path(directory, step, rank)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)
    pycomm.barrier()
    if rank == 0:
        _atomic_write_bytes(os.path.join(directory, "latest"), f"{step}\n".encode())
    pycomm.barrier()
    keep = sorted({int(m.group(1)) for m in (re.search(r"step(\d+)-rank", os.path.basename(p))
                                              for p in glob.glob(os.path.join(directory, f"step*-rank{rank}.pt"))) if m})
    for old in keep[:-2]:
        try:
            os.remove(_path(directory, old, rank))
        except FileNotFoundError:
            pass
    return path


def latest_step(directory: str) -> Optional[int]:
    try:
        with open(os.path.join(directory, "latest")) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def load(directory: str, step: int) -> Any:
    path = _path(directory, step, pycomm.rank())
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} is missing (the 'latest' marker names step {step})")
    return torch.load(path, weights_only=False)
