"""Process runtime: MPI bootstrap, topology and the engine's lifetime.

``init()`` initializes MPI through mpi4py with thread level MULTIPLE, makes a
private duplicate of COMM_WORLD for pycomm's traffic, splits it into a
node-local communicator (ranks sharing memory, or virtual nodes of
``PYCOMM_RANKS_PER_NODE`` ranks) and a cross-node communicator (one rank per
node with the same local rank), and starts the C++ engine on them.
"""
from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from typing import Optional

from . import _C

CommError = _C.CommError


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    homogeneous: bool  # every node has the same number of ranks
    virtual_nodes: bool  # nodes come from PYCOMM_RANKS_PER_NODE, not from shared memory


class _State:
    topology: Optional[Topology] = None
    world = None  # mpi4py communicators, private to pycomm
    local = None
    cross = None


_state = _State()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 0 or 1")


def mpi():
    """The mpi4py.MPI module, initialized with thread level MULTIPLE."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def init(ranks_per_node: Optional[int] = None) -> Topology:
    """Initialize MPI and start the engine. Idempotent; returns the topology.

    ranks_per_node: group ranks into virtual nodes of this many consecutive
    ranks (default: ``PYCOMM_RANKS_PER_NODE``, else the shared-memory split),
    so that multi-node code paths run on one machine.
    """
    if _state.topology is not None:
        return _state.topology
    MPI = mpi()
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        raise CommError(
            f"pycomm needs MPI thread level MULTIPLE but MPI provides level {provided}. "
            "Import pycomm (or set mpi4py.rc.thread_level = 'multiple') before mpi4py.MPI is first imported, "
            "and use an MPI built with thread support."
        )

    world = MPI.COMM_WORLD.Dup()
    world.Set_name("pycomm.world")
    if ranks_per_node is None:
        ranks_per_node = _env_int("PYCOMM_RANKS_PER_NODE", 0)
    if ranks_per_node < 0:
        raise ValueError(f"ranks_per_node must be positive, got {ranks_per_node}")
    virtual = ranks_per_node > 0
    if virtual:
        local = world.Split(color=world.rank // ranks_per_node, key=world.rank)
    else:
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)

    # A node is named by the world rank of its local rank 0; nodes are numbered
    # in the order of those ranks.
    leader = local.bcast(world.rank, root=0)
    leaders = world.allgather(leader)
    node_ids = sorted(set(leaders))
    node_rank = node_ids.index(leader)
    local_sizes = world.allgather(local.size)
    cross = world.Split(color=local.rank, key=node_rank)

    topo = Topology(
        rank=world.rank,
        size=world.size,
        local_rank=local.rank,
        local_size=local.size,
        node_rank=node_rank,
        num_nodes=len(node_ids),
        homogeneous=len(set(local_sizes)) == 1,
        virtual_nodes=virtual,
    )
    _C.engine_start(
        world.py2f(), local.py2f(), cross.py2f(),
        topo.rank, topo.size, topo.local_rank, topo.local_size, topo.node_rank, topo.num_nodes,
        _env_int("PYCOMM_RING_CHUNK_BYTES", 1 << 19),
        _env_int("PYCOMM_AUTO_RING_MIN_BYTES", 1 << 16),
        _env_bool("PYCOMM_CHECK_CONSISTENCY", True),
    )
    _state.world, _state.local, _state.cross, _state.topology = world, local, cross, topo
    atexit.register(shutdown)
    return topo


def shutdown() -> None:
    """Finish every queued collective, stop the engine and free pycomm's communicators."""
    if _state.topology is None:
        return
    _C.engine_stop()
    MPI = mpi()
    if not MPI.Is_finalized():
        for c in (_state.cross, _state.local, _state.world):
            c.Free()
    _state.world = _state.local = _state.cross = _state.topology = None


def is_initialized() -> bool:
    return _state.topology is not None


def topology() -> Topology:
    if _state.topology is None:
        raise CommError("pycomm is not initialized: call pycomm.init() first")
    return _state.topology


def rank() -> int:
    """This process's rank in the job."""
    return topology().rank


def size() -> int:
    """Number of ranks in the job."""
    return topology().size


def local_rank() -> int:
    """Rank within this (possibly virtual) node."""
    return topology().local_rank


def local_size() -> int:
    """Number of ranks on this (possibly virtual) node."""
    return topology().local_size


def node_rank() -> int:
    """Index of this node, 0 .. num_nodes() - 1."""
    return topology().node_rank


def num_nodes() -> int:
    return topology().num_nodes


def world_comm():
    """pycomm's private duplicate of COMM_WORLD (an mpi4py communicator)."""
    topology()
    return _state.world


def local_comm():
    """Communicator of the ranks on this node."""
    topology()
    return _state.local


def cross_comm():
    """Communicator of the ranks with this local rank, one per node, ordered by node."""
    topology()
    return _state.cross


def set_options(*, ring_chunk_bytes: Optional[int] = None, auto_ring_min_bytes: Optional[int] = None,
                check_consistency: Optional[bool] = None) -> None:
    """Change engine options; they apply from the next collective on.

    check_consistency: exchange a small signature (kind, dtype, shape, op,
    algorithm) before each collective so that ranks that disagree all raise an
    error naming the disagreement instead of hanging. One extra small
    allgather per call; on by default.
    """
    topology()
    cur = _C.get_options()
    _C.set_options(
        cur["ring_chunk_bytes"] if ring_chunk_bytes is None else int(ring_chunk_bytes),
        cur["auto_ring_min_bytes"] if auto_ring_min_bytes is None else int(auto_ring_min_bytes),
        cur["check_consistency"] if check_consistency is None else bool(check_consistency),
    )


def get_options() -> dict:
    topology()
    return dict(_C.get_options())
