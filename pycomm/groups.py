"""Process groups: collectives over a subset of the job's ranks.

``new_group(ranks)`` builds an MPI communicator over ``ranks`` (world ranks;
group rank i is ``ranks[i]``) and starts a pycomm engine of its own on it:
its own worker thread, coordinator (agreement check and stall watchdog),
fusion queue and topology (node-local and cross-node communicators computed
inside the group, with the world's node assignment, virtual nodes included).
So operations of different groups never share a queue: like torch's process
groups, each group orders its own operations, and a rank may have several
groups' operations in flight at once. The group starts with the world
engine's options at creation time.

Call ``new_group`` on every rank with the same ranks, in the same order
relative to other ``new_group`` calls (as with torch.distributed.new_group);
only members take part in building it. Non-members get a handle with
``is_member == False`` that every collective refuses.

When pycomm.elastic replaces the world (a recovery after a death, or a
grow), every group made on the old world is made again on the new one with
its surviving ranks, renumbered as the new world numbers them, and the same
handle keeps working (``rebuild``).
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from . import _C
from .runtime import CommError, Topology, mpi, node_topology, start_engine, topology, world_comm

_ids = itertools.count(1)
_live = {}  # id -> communicators of groups this rank belongs to (kept until destroy_group)
_made: List[weakref.ref] = []  # every group handle made here, members' and not, in creation order (rebuild)


@dataclass
class ProcessGroup:
    """A set of ranks with its own engine. ``rank``/``size`` are within the group."""

    id: int
    ranks: Tuple[int, ...]  # world ranks, in group-rank order
    rank: int  # this process's rank in the group, -1 if not a member
    topology: Optional[Topology] = None
    _comms: tuple = ()
    _destroyed: bool = False

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    def comm(self):
        """The group's mpi4py communicator (private to pycomm), or None on non-members."""
        return self._comms[0] if self._comms else None

    def __repr__(self) -> str:
        return f"pycomm.ProcessGroup(id={self.id}, ranks={list(self.ranks)}, rank={self.rank})"


def new_group(ranks: Sequence[int]) -> ProcessGroup:
    """Create a process group of the given world ranks (see the module docstring)."""
    world_topo = topology()
    ranks = list(ranks)
    if not ranks:
        raise ValueError("pycomm.new_group: ranks is empty; give at least one world rank")
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world_topo.size:
            raise ValueError(f"pycomm.new_group: rank {r!r} is not a rank of this job (0..{world_topo.size - 1})")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"pycomm.new_group: ranks {ranks} contain duplicates")
    group = ProcessGroup(next(_ids), tuple(ranks), -1)
    if world_topo.rank in ranks:
        group.rank, group.topology, group._comms = _build(group.id, ranks)
    _made.append(weakref.ref(group))
    return group


def _build(gid: int, ranks: List[int]):
    """Make group `gid` over `ranks` (world ranks) on this member: its communicators and engine. Collective
    over the members. Returns (rank in the group, topology, communicators)."""
    world_topo = topology()
    world = world_comm()
    comm = world.Create_group(world.group.Incl(ranks), tag=0x7067)
    comm.Set_name(f"pycomm.group{gid}")
    control = comm.Dup()
    # Nodes as the world sees them (shared memory or PYCOMM_RANKS_PER_NODE).
    local = comm.Split(color=world_topo.node_rank, key=comm.rank)
    cross, topo = node_topology(comm, local, world_topo.virtual_nodes)
    start_engine(gid, comm, local, cross, control, topo)
    _live[gid] = (comm, local, cross, control)
    return comm.rank, topo, _live[gid]


def snapshot() -> List[Tuple[ProcessGroup, Tuple[int, ...]]]:
    """The groups not destroyed, with their world ranks now: what rebuild() starts from (taken before
    the world changes, so that a recovery that shrinks twice translates from the same ranks)."""
    groups = [ref() for ref in _made]
    _made[:] = [weakref.ref(g) for g in groups if g is not None]
    return [(g, g.ranks) for g in groups if g is not None and not g._destroyed]


def rebuild(before: List[Tuple[ProcessGroup, Tuple[int, ...]]], old_world_group) -> None:
    """Make the groups of `before` (snapshot()) again on the new world, after pycomm.elastic replaced it.

    A group keeps its ranks that are still alive, in the same order, numbered as the new world numbers
    them (MPI_Group_translate_ranks from `old_world_group`, the old world's MPI group), and its id. Its
    old engine has stopped with the old world. Collective over each group's surviving members, in
    creation order, as new_group is. A group whose members all died has no ranks left: every survivor
    is outside it."""
    MPI = mpi()
    me = topology().rank
    new_world_group = world_comm().Get_group()
    try:
        for group, old_ranks in before:
            alive = MPI.Group.Translate_ranks(old_world_group, list(old_ranks), new_world_group)
            ranks = tuple(r for r in alive if r != MPI.UNDEFINED)
            group.ranks, group.rank, group.topology, group._comms = ranks, -1, None, ()
            if me in ranks:
                group.rank, group.topology, group._comms = _build(group.id, list(ranks))
    finally:
        new_world_group.Free()


def destroy_group(group: ProcessGroup) -> None:
    """Finish the group's queued operations, stop its engine and free its communicators."""
    group._destroyed = True  # on non-members too: pycomm.elastic does not make it again
    if not group.is_member or not group._comms:
        return
    _C.engine_stop(group.id)
    _live.pop(group.id, None)
    MPI = mpi()
    if not MPI.Is_finalized():
        for c in reversed(group._comms):
            c.Free()
    group._comms = ()


def group_id(group: Optional[ProcessGroup], what: str) -> int:
    """The engine id for `group` (0: the world), checking that this rank belongs to it."""
    if group is None:
        return 0
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"pycomm.{what}: group must be a pycomm.ProcessGroup from pycomm.new_group, "
                        f"got {type(group).__name__}")
    if not group.is_member:
        raise ValueError(f"pycomm.{what}: rank {topology().rank} is not a member of {group!r}; "
                         "call collectives of a group on its members only")
    if not group._comms:
        raise CommError(f"pycomm.{what}: {group!r} has been destroyed")
    return group.id


def group_size(group: Optional[ProcessGroup]) -> int:
    return topology().size if group is None else group.size


def group_rank(group: Optional[ProcessGroup]) -> int:
    return topology().rank if group is None else group.rank
