"""Registration of the "pycomm" torch.distributed backend and its creator.

Each torch process group gets a ``pycomm._C.ProcessGroupPycomm`` (a C++
``c10d::Backend``). The default group runs on pycomm's world engine (shared
with pycomm's own API, in one submission order); every other group
(``dist.new_group``) maps to a ``pycomm.new_group`` with its own engine. torch
asks for one backend per device type (cpu, cuda); both share the group's
engine. Point-to-point (send/recv) runs on a communicator of its own per group.
"""
from __future__ import annotations

import os
import socket
from typing import Dict

import torch.distributed as dist

from .. import _C, collectives
from ..groups import ProcessGroup, new_group
from ..runtime import CommError, init, topology, world_comm

BACKEND_NAME = "pycomm"

# (torch group name, world ranks) -> (pycomm group id, p2p communicator, pycomm ProcessGroup or None)
_groups: Dict[tuple, tuple] = {}


def _create(dist_backend_opts, backend_options):
    """torch's extended creator API: (_DistributedBackendOptions, backend options)."""
    topo = init()
    compression = _compression()
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    ranks = list(dist_backend_opts.global_ranks_in_group) or list(range(topo.size))
    # torch asks once per device type; a later init_process_group may reuse a name for the same ranks.
    key = (str(dist_backend_opts.group_id), tuple(ranks))
    if key not in _groups:
        if not dist.is_initialized():  # the default group: all ranks, on the world engine
            if (rank, size) != (topo.rank, topo.size):
                raise ValueError(
                    f"pycomm backend: torch says rank {rank} of {size} but MPI says rank {topo.rank} of {topo.size}; "
                    "launch with pycomm-run/mpirun and leave RANK/WORLD_SIZE unset (or set them to MPI's)")
            p2p = world_comm().Dup()
            _groups[key] = (0, p2p, None)
        else:
            group: ProcessGroup = new_group(ranks)
            p2p = group.comm().Dup()
            _groups[key] = (group.id, p2p, group)
    gid, p2p, _ = _groups[key]
    return _C.ProcessGroupPycomm(rank, size, gid, p2p.py2f(), compression)


COMPRESSIONS = collectives.COMPRESSIONS  # the engine's table


def _compression() -> str:
    """PYCOMM_COMPRESSION as read when a process group is created (unset: none)."""
    c = os.environ.get("PYCOMM_COMPRESSION", "").strip().lower() or "none"
    if c not in COMPRESSIONS:
        raise ValueError(f"pycomm backend: PYCOMM_COMPRESSION={os.environ['PYCOMM_COMPRESSION']!r} is not a "
                         f"compression; choose one of {', '.join(COMPRESSIONS)} (or leave it unset)")
    return c


def register() -> None:
    """Register backend "pycomm" for cpu and cuda (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def rebuild_after_world_change() -> None:
    """Make torch.distributed's default group again on pycomm's new world, after pycomm.elastic shrank or
    grew the job (docs/elastic.md). Collective over the new world; nothing when torch.distributed is not
    initialized. Every torch group made before (dist.new_group) is destroyed with the old default group:
    make them again after this (a reset callback). A default group of another backend: CommError."""
    if not dist.is_initialized():
        return
    backend = str(dist.get_backend())
    if backend != BACKEND_NAME:
        raise CommError(f"pycomm.elastic: the job changed size, and torch.distributed's default group (backend "
                        f"{backend!r}) cannot follow it; only backend {BACKEND_NAME!r} is rebuilt on the new world")
    # The old groups' point-to-point communicators stay allocated: after a death they are revoked, and
    # freeing one is collective over a group that lost a member (as the world's in pycomm.elastic.recovery).
    dist.destroy_process_group()
    _groups.clear()
    bootstrap_env(force=True)
    topo = topology()
    dist.init_process_group(BACKEND_NAME, rank=topo.rank, world_size=topo.size)


def bootstrap_env(force: bool = False) -> None:
    """Provide torch's env:// rendezvous from MPI unless MASTER_ADDR is already set (force: set it again,
    with RANK and WORLD_SIZE, for a job that changed size)."""
    if os.environ.get("MASTER_ADDR") and not force:
        return
    topo = init()
    world = world_comm()
    hosts = world.allgather(socket.gethostname())
    port = None
    if topo.rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    addr = "127.0.0.1" if len(set(hosts)) == 1 else socket.getfqdn(hosts[0])
    port = world.bcast(port, root=0)
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)
    if force:
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(topo.rank), str(topo.size)
    else:
        os.environ.setdefault("RANK", str(topo.rank))
        os.environ.setdefault("WORLD_SIZE", str(topo.size))
