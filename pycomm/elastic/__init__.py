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
import sys
import time
from typing import Callable, List, Optional

from .. import runtime
from ..runtime import RanksFailedError
from .recovery import Recovery, agree, is_rank_failure, shrink_and_restart
from .sampler import ElasticSampler
from .state import State, TorchState

recoveries: List[Recovery] = []  # every recovery of this process, in order


def run(state: State, min_size: int = 1) -> Callable:
    """Decorate a training function ``fn(state, *args)`` to survive rank deaths.

    On entry the state is synced (every rank takes rank 0's). A rank failure seen anywhere in the
    call (RanksFailedError, or an MPI failure of pycomm's own mpi4py traffic) leads to a recovery
    and a new call of ``fn`` on the restored state. Fewer than `min_size` ranks left: CommError.
    Other exceptions pass through.
    """
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            runtime.topology()
            if not runtime._state.elastic:
                raise runtime.CommError("pycomm.elastic.run: elastic mode is off; call pycomm.init(elastic=True) "
                                        "(or set PYCOMM_ELASTIC=1) and launch with pycomm-run --elastic")
            after_failure = None  # what the last recovery followed (its message)
            while True:
                ok, result = True, None
                try:
                    if after_failure is not None:
                        state.restore()
                    state.sync()
                    if after_failure is not None:
                        state.on_reset()
                    result = fn(state, *args, **kwargs)
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
                if recovery.size_after < min_size:
                    raise runtime.CommError(f"pycomm.elastic: {recovery.size_after} rank(s) left after losing ranks "
                                            f"{list(recovery.lost)}; the job needs at least {min_size}")
        return wrapper
    return decorate


__all__ = ["ElasticSampler", "RanksFailedError", "Recovery", "State", "TorchState", "agree", "is_rank_failure", "recoveries",
           "run", "shrink_and_restart"]
