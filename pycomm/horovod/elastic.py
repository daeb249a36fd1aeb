"""Horovod's elastic API (``hvd.elastic``) over pycomm.elastic (docs/elastic.md).

    @hvd.elastic.run
    def train(state):
        ...
    state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0)
    train(state)

Launch with ``pycomm-run --elastic`` (it sets PYCOMM_ELASTIC=1, so ``hvd.init()`` starts pycomm in
elastic mode). A rank's death raises pycomm.RanksFailedError on the survivors, and ``run``
recovers on them as pycomm.elastic.run does. Horovod's host discovery (adding hosts while the job
runs) has no counterpart here: the job goes on with the ranks left.
"""
from __future__ import annotations

import functools
from typing import Callable

import pycomm.elastic as _elastic
from pycomm.elastic import ElasticSampler, State, TorchState

def run(func: Callable) -> Callable:
    """Horovod's decorator: ``func(state, *args)`` is called again on the survivors after a rank dies."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        return _elastic.run(state)(func)(*args, **kwargs)
    return wrapper


__all__ = ["ElasticSampler", "State", "TorchState", "run"]
