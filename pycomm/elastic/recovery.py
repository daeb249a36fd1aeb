"""Recovery of pycomm's runtime on the survivors of a rank's death (docs/elastic.md).

Under MPI's fault tolerance (ULFM) the survivors revoke pycomm's
communicators, stop the engine (its last round fails at once: the failure is
remembered, csrc/comm/fault.h), shrink the world to the live ranks and build
everything pycomm keeps on it again: the world, control, node and cross-node
communicators, the topology, the engine with its shared-memory window, and
the agreed tune table (pycomm.runtime._start), and every process group with
its surviving ranks (pycomm.groups.rebuild).
"""
from __future__ import annotations

import time
from typing import Tuple

from .. import _C, groups, runtime
from ..runtime import CommError, RanksFailedError


def is_rank_failure(error: BaseException) -> bool:
    """Whether `error` reports a rank's death: pycomm's RanksFailedError, or an mpi4py MPI.Exception of
    class MPI_ERR_PROC_FAILED, MPI_ERR_PROC_FAILED_PENDING or MPI_ERR_REVOKED (pycomm's own mpi4py calls on
    its world communicator, e.g. TorchState.sync)."""
    if isinstance(error, RanksFailedError):
        return True
    MPI = runtime.mpi()
    if isinstance(error, MPI.Exception):
        return error.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)
    return False


def agree(comm, ok: bool) -> bool:
    """Whether every rank of `comm` passed ok=True and none has died: MPI's fault-tolerant agreement
    (MPIX_Comm_agree), which gives every survivor the same answer, also on a revoked communicator."""
    MPI = runtime.mpi()
    try:
        return bool(comm.Agree(1 if ok else 0))
    except MPI.Exception as error:  # a failed member: reported to every survivor alike
        if is_rank_failure(error):
            return False
        raise


def _revoke(comms) -> None:
    for c in comms:
        if c is not None and not c.Is_revoked():
            c.Revoke()


class Recovery:
    """What one recovery did: the ranks that were lost (world ranks before it), the world sizes before
    and after, and how long it took."""

    def __init__(self, lost: Tuple[int, ...], size_before: int, size_after: int, seconds: float):
        self.lost, self.size_before, self.size_after, self.seconds = lost, size_before, size_after, seconds

    def __repr__(self) -> str:
        return (f"Recovery(lost={list(self.lost)}, size {self.size_before} -> {self.size_after}, "
                f"{self.seconds:.3f} s)")


def elastic_state(what: str):
    """The runtime's state, or CommError (naming `what`) when pycomm is not running in elastic mode."""
    st = runtime._state
    if st.topology is None:
        raise CommError(f"{what}: pycomm is not initialized: call pycomm.init(elastic=True) first")
    if not st.elastic:
        raise CommError(f"{what}: elastic mode is off; call pycomm.init(elastic=True) "
                        "(or set PYCOMM_ELASTIC=1) and launch with pycomm-run --elastic")
    return st


def shrink_and_restart() -> Recovery:
    """Revoke pycomm's communicators, shrink the world to the live ranks and start pycomm on it again.

    Collective over the survivors; each must call it after seeing a rank failure. A death during the
    recovery itself shrinks again. Raises CommError outside elastic mode.
    """
    st = elastic_state("pycomm.elastic")
    start = time.perf_counter()
    MPI = runtime.mpi()
    base = st.world
    before = base.Get_group()
    size_before = base.Get_size()
    # Every survivor's pending call on these fails at once, wherever it waits.
    # The options set_options gave the old engine (pycomm.horovod's pair_by_name, say), without the
    # tune table: that one is agreed again for the new shape.
    options = {k: v for k, v in _C.get_options().items() if k != "auto_table"}
    made = groups.snapshot()
    _revoke((st.world, st.control, st.local, st.cross))
    _stop_engine()
    ranks_per_node = st.ranks_per_node
    st.world = st.local = st.cross = st.control = st.topology = None  # revoked; never freed (runtime.shutdown)
    while True:
        shrunk = base.Shrink()
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        started = True
        try:
            runtime._start(shrunk, ranks_per_node, True)
            _C.set_options({**_C.get_options(), **options})
            groups.rebuild(made, before)
        except Exception as error:  # a death during the restart
            if not is_rank_failure(error):
                raise
            started = False
        # MPI may report a death inside a collective to some ranks and not to others: the agreement
        # gives every survivor the same answer, so all keep this world or all shrink it again.
        if agree(shrunk, started):
            break
        _revoke((shrunk, st.world, st.control, st.local, st.cross))
        _stop_engine()
        st.world = st.local = st.cross = st.control = st.topology = None
        base = shrunk
    world_group = runtime._state.world.Get_group()
    alive = set(MPI.Group.Translate_ranks(world_group, list(range(world_group.Get_size())), before))
    lost = tuple(r for r in range(size_before) if r not in alive)
    world_group.Free()
    before.Free()
    return Recovery(lost, size_before, runtime._state.topology.size, time.perf_counter() - start)


def _stop_engine() -> None:
    """Revoke the groups' communicators (the caller revoked the world's) and stop the world's and the
    groups' engines. With their communicators revoked, the engines' shutdown rounds fail at once and
    each remembers the failure (csrc/comm/fault.h): they free nothing collective."""
    _revoke([c for comms in groups._live.values() for c in comms])
    if _C.engine_running():
        _C.engine_stop()
    groups._live.clear()  # their communicators are revoked and stay allocated, like the world's
    _C.fault_disable()
