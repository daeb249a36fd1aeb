"""hvd.join and the timeline: thin forwards to pycomm's own functions."""
from __future__ import annotations

import pycomm


def join(device=-1) -> int:
    """This rank has no more batches: answer the others' allreduces with zeros until every rank joined.

    Returns the rank that joined last (Horovod's join). `device` is accepted for
    Horovod compatibility (the zero buffers match each operation's tensors).
    """
    fn = getattr(pycomm, "join", None)
    if fn is None:
        raise NotImplementedError("hvd.join: this pycomm build has no pycomm.join")
    return fn()


def start_timeline(file_path, mark_cycles=False) -> None:
    """Write a Chrome-trace timeline of pycomm's operations to `file_path` (pycomm.start_timeline)."""
    fn = getattr(pycomm, "start_timeline", None)
    if fn is None:
        raise NotImplementedError("hvd.start_timeline: this pycomm build has no timeline (pycomm.start_timeline)")
    fn(file_path)


def stop_timeline() -> None:
    fn = getattr(pycomm, "stop_timeline", None)
    if fn is None:
        raise NotImplementedError("hvd.stop_timeline: this pycomm build has no timeline (pycomm.stop_timeline)")
    fn()
