"""Growing the job: spawn new ranks, merge them into pycomm's world and start pycomm on it (docs/elastic.md).

The running ranks spawn the new processes together (MPI_Comm_spawn on pycomm's world), merge the
intercommunicator with them (old ranks first, in their order), stop pycomm's engine on the old world
and start it on the merged one, as a recovery does on a shrunk world (recovery.shrink_and_restart).
The new processes run the same command; their ``pycomm.init(elastic=True)`` sees that they were
spawned to join (runtime.JOIN_ENV, runtime._join) and takes the other side of the merge; in
``pycomm.elastic.run`` they receive the committed state from rank 0 before the training function runs.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Dict, Optional, Sequence

from .. import _C, groups, runtime
from ..runtime import CommError
from .recovery import elastic_state


class Growth:
    """What one grow did: how many ranks it added, the world sizes before and after, and how long it took."""

    def __init__(self, added: int, size_before: int, size_after: int, seconds: float):
        self.added, self.size_before, self.size_after, self.seconds = added, size_before, size_after, seconds

    def __repr__(self) -> str:
        return f"Growth(added={self.added}, size {self.size_before} -> {self.size_after}, {self.seconds:.3f} s)"


def job_command() -> list:
    """The command this process was started with: this interpreter and its original arguments
    (``python -m module ...`` stays a module run)."""
    return [sys.executable, *sys.orig_argv[1:]]


# Not forwarded to spawned processes: the launcher's own per-process variables (Open MPI, PMIx, PRRTE,
# MPICH/hydra), which name this process's place in its own launch, and torch's rendezvous variables, which
# pycomm.distributed sets on each rank from MPI (pycomm.distributed.backend.bootstrap_env).
NOT_FORWARDED_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "PRRTE_", "OPAL_", "HYDRA_", "PMI_", "MPI_LOCAL")
NOT_FORWARDED = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"}


def forwarded_environment(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The variables of `env` (default os.environ: rank 0's, which spawns) that the new processes get, so
    that they run as the job's ranks do (the launcher gives spawned processes its own environment, without
    what ``mpirun -x`` exported to the ranks)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items()
            if not k.startswith(NOT_FORWARDED_PREFIXES) and k not in NOT_FORWARDED and "\n" not in v and "\n" not in k}


def spawn_info(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The MPI_Info of the spawn: the new processes may share cores with the job (map_by :OVERSUBSCRIBE:
    without it Open MPI refuses a spawn on a host whose slots are all taken) and start in this working
    directory. `extra` keys override."""
    info = {"map_by": ":OVERSUBSCRIBE", "wdir": os.getcwd()}
    info.update(extra or {})
    return info


def spawn_command(command: Sequence[str]) -> list:
    """What MPI_Comm_spawn runs: `command` under env(1) with this process's environment
    (forwarded_environment) and the variables that make it join in elastic mode (runtime.JOIN_ENV). The
    environment goes on the command line: MPI_Info values are too short for it (MPI_MAX_INFO_VAL)."""
    env_program = shutil.which("env")
    if env_program is None:
        raise CommError("pycomm.elastic.grow: no env program on PATH to start the new processes with the job's "
                        "environment")
    env = {**forwarded_environment(), runtime.JOIN_ENV: "1", "PYCOMM_ELASTIC": "1"}
    return [env_program, *(f"{k}={v}" for k, v in env.items()), *command]


def spawn_and_restart(k: int, command: Optional[Sequence[str]] = None,
                      info: Optional[Dict[str, str]] = None) -> Growth:
    """Add `k` ranks to the job and start pycomm on the grown world. Collective over the current world.

    command: the new processes' command line (default: job_command(), the job's own). info: MPI_Info keys
    for the spawn, over spawn_info()'s. The old ranks keep their ranks; the new ones follow them.
    Process groups are made again on the grown world with the same ranks (the new ranks are outside
    them), as after a recovery. Raises CommError outside elastic mode.
    """
    st = elastic_state("pycomm.elastic.grow")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"pycomm.elastic.grow: k must be a positive number of ranks, got {k!r}")
    command = list(command) if command is not None else job_command()
    if not command:
        raise ValueError("pycomm.elastic.grow: command is empty")
    start = time.perf_counter()
    MPI = runtime.mpi()
    size_before = st.topology.size
    options = {k_: v for k_, v in _C.get_options().items() if k_ != "auto_table"}
    # The engine owns the world's communicators while it runs: stop it (its shutdown round finishes the
    # queued operations) before the spawn uses them from here.
    made = groups.snapshot()
    old_world_group = st.world.Get_group()
    _C.engine_stop()  # every engine: the groups' and the world's
    for gid in sorted(groups._live):  # every member frees its groups' communicators in the same order
        for c in reversed(groups._live[gid]):
            c.Free()
    groups._live.clear()
    _C.fault_disable()
    old = (st.control, st.cross, st.local, st.world)
    mpi_info = MPI.Info.Create()
    for key, value in spawn_info(info).items():
        mpi_info.Set(key, value)
    try:
        full = spawn_command(command)
        inter = st.world.Spawn(full[0], full[1:], maxprocs=k, info=mpi_info, root=0)
    except Exception:
        # No process joined: pycomm goes on with the ranks it had (a new engine on the old world; a rank's
        # death here fails that restart too, and its error follows this one), and the error propagates.
        world = st.world
        st.world = st.local = st.cross = st.control = st.topology = None
        _restart(world, st.ranks_per_node, options, made, old_world_group)
        raise
    finally:
        mpi_info.Free()
    merged = runtime.merged_world(inter, high=False)
    for c in old:
        c.Free()
    st.world = st.local = st.cross = st.control = st.topology = None
    config = {"ranks_per_node": st.ranks_per_node, "options": options}
    merged.bcast(config if merged.rank == 0 else None, root=0)  # the new ranks' runtime._join receives it
    _restart(merged, config["ranks_per_node"], options, made, old_world_group)
    return Growth(k, size_before, st.topology.size, time.perf_counter() - start)


def _restart(world, ranks_per_node, options, made, old_world_group) -> None:
    """Start pycomm on `world` (the grown one, or the old one after a failed spawn) with the old engine's
    options, and make the groups of `made` (groups.snapshot()) again on it."""
    runtime._start(world, ranks_per_node, True)
    _C.set_options({**_C.get_options(), **options})
    groups.rebuild(made, old_world_group)
    old_world_group.Free()
