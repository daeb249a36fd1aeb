"""hvd.join and the timeline: thin forwards to pycomm's own functions."""
from __future__ import annotations

import pycomm


def join(device=-1) -> int:
    """This rank has no more batches: answer the others' allreduces with zeros until every rank joined.

    Returns the rank that joined last (Horovod's join); see pycomm.join. As in
    Horovod, the others' allgathers and broadcasts raise while this rank is joined.
    `device` is accepted for Horovod compatibility (a joined rank answers with host
    buffers).
    """
    del device
    return pycomm.join(answer_gathers=False)


def start_timeline(file_path, mark_cycles=False) -> None:
    """Write a Chrome-trace timeline of pycomm's operations (pycomm.start_timeline).

    Unlike Horovod's single file from rank 0, every rank writes its own:
    `file_path` with ".rank<r>" before the extension.
    """
    pycomm.start_timeline(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    pycomm.stop_timeline()
