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
import pickle
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


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read: corrupt, truncated, or carrying types pycomm never saves."""


def load(directory: str, step: int) -> Any:
    """This rank's checkpoint of `step`.

    Loaded with ``torch.load(weights_only=True)``: only tensors, containers and
    plain values (what pycomm saves) are unpickled, so a file from elsewhere
    cannot run code. Anything else raises CheckpointError naming the file.
    """
    path = _path(directory, step, pycomm.rank())
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} is missing (the 'latest' marker names step {step})")
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message explains weights_only at length; keep the first line (which global it refused).
        first = str(e).strip().splitlines()
        cause = next((ln for ln in first if "Unsupported global" in ln or "GLOBAL" in ln), first[0] if first else "")
        raise CheckpointError(f"checkpoint {path} holds something other than tensors and plain values, which "
                              f"pycomm never saves; refusing to load it ({cause.strip()})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated: {type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'}") from None
