"""Horovod process sets over pycomm process groups.

``hvd.ProcessSet(ranks)`` describes a subset of the job; ``hvd.add_process_set``
(collective: every rank calls it, in the same order) builds a
``pycomm.new_group`` for it, and collectives take ``process_set=`` like
Horovod's. ``global_process_set`` is the whole job (pycomm's default group).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import pycomm


class ProcessSet:
    """A set of world ranks; ``rank()``/``size()`` are within the set (rank() is -1 outside it)."""

    def __init__(self, ranks_or_comm: Optional[Sequence[int]] = None):
        if ranks_or_comm is not None and not isinstance(ranks_or_comm, (list, tuple, range)):
            if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator: its members' world ranks
                MPI = pycomm.runtime.mpi()
                ranks_or_comm = MPI.Group.Translate_ranks(ranks_or_comm.Get_group(),
                                                          list(range(ranks_or_comm.Get_size())),
                                                          MPI.COMM_WORLD.Get_group())
            else:
                raise TypeError("hvd.ProcessSet takes a list of ranks or an mpi4py communicator, got "
                                f"{type(ranks_or_comm).__name__}")
        self.ranks: Optional[List[int]] = None if ranks_or_comm is None else sorted(int(r) for r in ranks_or_comm)
        self.process_set_id: Optional[int] = None
        self._group: Optional["pycomm.ProcessGroup"] = None
        self._lost = False  # every rank of it died and pycomm.elastic replaced the world (follow_world_change)

    def _global(self) -> bool:
        return self is global_process_set

    def size(self) -> int:
        if self._global():
            return pycomm.size()
        self._check("size")
        return self._group.size

    def rank(self) -> int:
        if self._global():
            return pycomm.rank()
        self._check("rank")
        return self._group.rank

    def included(self) -> bool:
        return self._global() or (self._group is not None and self._group.is_member)

    def _check(self, what: str) -> None:
        if self._lost:
            raise pycomm.CommError(f"hvd.ProcessSet({self.ranks}).{what}(): every rank of the set died and pycomm.elastic "
                                   "went on without them; add a process set again with hvd.add_process_set "
                                   "(in a reset callback)")
        if self._group is None:
            raise ValueError(f"hvd.ProcessSet({self.ranks}).{what}(): the set is not registered; call "
                             "hvd.add_process_set() on every rank first")

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and self.ranks == other.ranks and \
            self.process_set_id == other.process_set_id

    def __hash__(self):
        return id(self)

    def __repr__(self) -> str:
        if self._global():
            return "ProcessSet(process_set_id=0, global)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0
_registered: List[ProcessSet] = []


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks) on every rank; returns the ProcessSet."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set._global() or process_set.ranks is None:
        raise ValueError("hvd.add_process_set: give the set's ranks; the global set exists already")
    process_set._lost = False
    if process_set._group is not None:
        raise ValueError(f"hvd.add_process_set: {process_set!r} is already registered")
    for other in _registered:
        if other.ranks == process_set.ranks:
            raise ValueError(f"hvd.add_process_set: a process set with ranks {process_set.ranks} is already "
                             f"registered ({other!r})")
    process_set._group = pycomm.new_group(process_set.ranks)
    process_set.process_set_id = process_set._group.id
    _registered.append(process_set)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank (finishes its queued operations). False if it was not registered."""
    if process_set._global():
        raise ValueError("hvd.remove_process_set: the global process set cannot be removed")
    if process_set not in _registered:
        return False
    pycomm.destroy_group(process_set._group)
    _registered.remove(process_set)
    process_set._group = None
    process_set.process_set_id = None
    return True


def follow_world_change() -> None:
    """pycomm.elastic shrank or grew the job and made every group again with its surviving ranks
    (pycomm.groups.rebuild): each registered set takes its group's new ranks, in the new world's
    numbering. A set whose ranks all died is lost: using it raises CommError saying to add it again."""
    for ps in list(_registered):
        if ps._group.ranks:
            ps.ranks = list(ps._group.ranks)
        else:
            ps._group, ps.process_set_id, ps._lost = None, None, True
            _registered.remove(ps)


def _remove_all() -> None:
    for ps in list(_registered):
        remove_process_set(ps)


def _group(process_set, what: str):
    """The pycomm group of `process_set` (None: the world)."""
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"pycomm.horovod.{what}: process_set must be an hvd.ProcessSet, got "
                        f"{type(process_set).__name__}")
    process_set._check(what)
    return process_set._group
