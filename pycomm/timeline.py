"""The timeline: a Chrome trace of pycomm's operations, and ranges in torch.profiler.

``PYCOMM_TIMELINE=path.json`` (read by ``pycomm.init()``) or
``pycomm.start_timeline(path)`` makes every rank write a catapult
"traceEvents" JSON file: rank r writes ``path`` with ``.rank<r>`` before the
extension (``timeline.json`` -> ``timeline.rank0.json``), with ``pid`` = r,
so the files of a job can be opened together in chrome://tracing or
ui.perfetto.dev. Each tensor name is a lane (``tid``); per operation the lane
shows QUEUED (submission until its coordination round), then the operation
(ALLREDUCE, BROADCAST, ...; its end event lists the ``tensors`` of its fused
batch) containing NEGOTIATE (the coordination round), PACK, the algorithm
(RING_ALLREDUCE, MPI_ALLREDUCE, SHM_ALLREDUCE, HIERARCHICAL_ALLREDUCE, ...)
with its phases (REDUCE_SCATTER, CROSS_NODE, ALLGATHER, ...), UNPACK, and a
DONE instant. ``stop_timeline()`` closes what is open and the file, so a
timeline started and stopped mid-run is valid JSON with nested ranges.

Recording is in C++ (csrc/comm/timeline.cpp); off, each hook costs one load of
an atomic flag. Independently of the file, pycomm's Python calls open
``torch.autograd.profiler.record_function`` ranges ("pycomm.allreduce", ...)
while a torch profiler runs, so pycomm shows up in torch's traces.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch.autograd.profiler import record_function

from . import _C
from .runtime import start_timeline_from_env as start_from_env  # noqa: F401 (pycomm.init() calls it)
from .runtime import topology

_profiler_enabled = torch._C._autograd._profiler_enabled


def start_timeline(path, mark_cycles: bool = False) -> str:
    """Start writing this rank's timeline; returns its file name (``path`` with ``.rank<r>``).

    mark_cycles: accepted for Horovod compatibility; pycomm's lanes show every
    coordination round (NEGOTIATE) already.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"pycomm.start_timeline: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not path:
        raise ValueError("pycomm.start_timeline: path is empty; give a file name such as 'timeline.json'")
    del mark_cycles
    _C.timeline_start(path, topology().rank)
    return _C.timeline_path()


def stop_timeline() -> None:
    """Close the running timeline's open ranges and its file (nothing happens if none runs)."""
    _C.timeline_stop()


def timeline_path() -> Optional[str]:
    """This rank's timeline file while one is written, else None."""
    return _C.timeline_path() or None


def profiled(name: str):
    """Decorator: run the call inside record_function(name) while a torch profiler is active."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not _profiler_enabled():
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)
        return call
    return wrap
