"""Elastic training: the job goes on when ranks die (docs/elastic.md).

    pycomm.init(elastic=True)            # launched with pycomm-run --elastic
    state = pycomm.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @pycomm.elastic.run(state)
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...one step...
            state.commit()

    train()

When a rank dies, every survivor's pycomm call raises RanksFailedError; ``run`` then shrinks the
world to the survivors and starts pycomm on it again (recovery.shrink_and_restart), returns every
survivor to the last commit of the lowest surviving rank (restore, then sync), calls the reset
callbacks, and calls the training function again.
"""
from __future__ import annotations

import functools
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from .. import runtime
from ..runtime import RanksFailedError
from .grow import Growth, job_command, spawn_and_restart, spawn_info
from .recovery import Recovery, agree, is_rank_failure, shrink_and_restart
from .sampler import ElasticSampler
from .state import State, TorchState

recoveries: List[Recovery] = []  # every recovery of this process, in order
growths: List[Growth] = []  # every grow this process took part in as an old rank, in order
MIN_NP_ENV, MAX_NP_ENV = "PYCOMM_ELASTIC_MIN_NP", "PYCOMM_ELASTIC_MAX_NP"  # set by pycomm-run --min-np/--max-np
_running = [0]  # depth of run() wrappers this process is inside
_joined_unsynced = [True]  # a joined process has not yet received the state (its first run() entry)


class WorldGrown(Exception):
    """Raised by grow() inside a function that run() wraps, after the job grew: run() catches it, returns
    every rank to the last commit (the new ranks receive it), calls the reset callbacks and calls the
    function again on the grown world."""

    def __init__(self, growth: Growth):
        super().__init__(f"pycomm.elastic: the job grew to {growth.size_after} ranks")
        self.growth = growth


def joined() -> bool:
    """Whether this process was started by grow() and joined a running job (its pycomm.init(elastic=True)
    merged it in, after the ranks that were there)."""
    return runtime.joined()


def grow(k: int, command: Optional[Sequence[str]] = None, info: Optional[Dict[str, str]] = None) -> Growth:
    """Add `k` ranks to the job. Collective over every rank of the job.

    The new processes run `command` (default: this process's own command line, job_command()) and join in
    their ``pycomm.init(elastic=True)``; the ranks there keep their ranks, the new ones follow in order.
    `info`: MPI_Info keys for the spawn, over spawn_info()'s. Inside a function that run() wraps, grow
    raises WorldGrown after the job grew, and run() returns every rank, new ones included, to the last
    commit (commit just before growing to lose nothing) and calls the function again. Outside run() it
    returns the Growth; the new ranks then meet the old ones at their first collective (run()'s entry
    syncs the state from rank 0). Process groups are made again with the same ranks, as after a recovery.
    """
    growth = spawn_and_restart(k, command, info)
    growths.append(growth)
    _rebuild_frameworks()
    if runtime.rank() == 0:
        sys.stderr.write(f"pycomm.elastic: grew to {growth.size_after} rank(s) in {growth.seconds:.3f} s\n")
        sys.stderr.flush()
    if _running[0]:
        raise WorldGrown(growth)
    return growth


def _bounds(min_size: Optional[int], max_size: Optional[int]):
    """min_size and max_size as given, else from PYCOMM_ELASTIC_MIN_NP / PYCOMM_ELASTIC_MAX_NP (1 and none)."""
    if min_size is None:
        min_size = runtime._env_int(MIN_NP_ENV, 1)
    if max_size is None:
        max_size = runtime._env_int(MAX_NP_ENV, 0) or None
    if min_size < 1:
        raise ValueError(f"pycomm.elastic.run: min_size must be at least 1, got {min_size}")
    if max_size is not None and max_size < min_size:
        raise ValueError(f"pycomm.elastic.run: max_size {max_size} is below min_size {min_size}")
    return min_size, max_size


def _rebuild_frameworks() -> None:
    """After the world changed: the torch.distributed default group, made again on the new world, and
    pycomm.horovod's process sets, which follow their pycomm groups' new ranks (docs/elastic.md)."""
    if "pycomm.distributed.backend" in sys.modules:
        sys.modules["pycomm.distributed.backend"].rebuild_after_world_change()
    if "pycomm.horovod.process_sets" in sys.modules:
        sys.modules["pycomm.horovod.process_sets"].follow_world_change()


def run(state: State, min_size: Optional[int] = None, max_size: Optional[int] = None) -> Callable:
    """Decorate a training function ``fn(state, *args)`` to survive rank deaths.

    On entry the state is synced (every rank takes rank 0's). A rank failure seen anywhere in the
    call (RanksFailedError, or an MPI failure of pycomm's own mpi4py traffic) leads to a recovery
    and a new call of ``fn`` on the restored state. Fewer than `min_size` ranks left: CommError on
    every survivor. Fewer than `max_size` (and at least `min_size`): the survivors spawn the missing
    ranks (grow) before going on. Defaults: PYCOMM_ELASTIC_MIN_NP and PYCOMM_ELASTIC_MAX_NP
    (pycomm-run --min-np/--max-np), else 1 and no growing. Other exceptions pass through.
    """
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            runtime.topology()
            if not runtime._state.elastic:
                raise runtime.CommError("pycomm.elastic.run: elastic mode is off; call pycomm.init(elastic=True) "
                                        "(or set PYCOMM_ELASTIC=1) and launch with pycomm-run --elastic")
            low, high = _bounds(min_size, max_size)
            after_failure = None  # what the last recovery or grow followed (its message)
            if runtime._state.joined and _joined_unsynced[0]:
                after_failure, _joined_unsynced[0] = "joined", False  # the old ranks come from a grow
            _running[0] += 1
            try:
                while True:
                    ok, result = True, None
                    try:
                        if after_failure is not None and after_failure != "joined":
                            state.restore()
                        state.sync()
                        if after_failure is not None:
                            state.on_reset()
                        result = fn(state, *args, **kwargs)
                    except WorldGrown as grown:
                        after_failure = str(grown)
                        continue
                    except Exception as error:
                        if not is_rank_failure(error):
                            raise
                        ok, after_failure = False, str(error)
                    # A rank may finish while another sees a death in the same last collective: the
                    # agreement makes every survivor either return or recover, together.
                    if agree(runtime.world_comm(), ok):
                        return result
                    if ok:  # this rank saw no failure, another did
                        after_failure = "another rank saw ranks fail"
                    recovery = shrink_and_restart()
                    recoveries.append(recovery)
                    if runtime.rank() == 0:
                        sys.stderr.write(f"pycomm.elastic: {after_failure}\npycomm.elastic: recovered on "
                                         f"{recovery.size_after} rank(s) in {recovery.seconds:.3f} s (lost world ranks "
                                         f"{list(recovery.lost)})\n")
                        sys.stderr.flush()
                    if recovery.size_after < low:
                        too_few = runtime.CommError(f"pycomm.elastic: {recovery.size_after} rank(s) left after losing "
                                                    f"ranks {list(recovery.lost)}; the job needs at least {low} "
                                                    f"(min_size, pycomm-run --min-np)")
                        too_few.raised_on_every_rank = True  # the abort hook lets each rank end by itself
                        raise too_few
                    if high is not None and recovery.size_after < high:
                        growth = spawn_and_restart(high - recovery.size_after)
                        growths.append(growth)
                        if runtime.rank() == 0:
                            sys.stderr.write(f"pycomm.elastic: grew back to {growth.size_after} rank(s) in "
                                             f"{growth.seconds:.3f} s\n")
                            sys.stderr.flush()
                    _rebuild_frameworks()
            finally:
                _running[0] -= 1
        return wrapper
    return decorate


__all__ = ["ElasticSampler", "Growth", "RanksFailedError", "Recovery", "State", "TorchState", "WorldGrown", "agree",
           "grow", "growths", "is_rank_failure", "job_command", "joined", "recoveries", "run", "shrink_and_restart",
           "spawn_and_restart", "spawn_info"]
