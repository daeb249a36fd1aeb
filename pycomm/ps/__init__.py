"""Asynchronous training's transport: a sharded parameter server over MPI point-to-point (docs/algorithms.md §5).

``ParameterServer`` (placement, push/pull, SSP clocks, staleness statistics, state), ``UpdateRule`` (the
server's C++ update rules: SGD with momentum, DC-ASGD compensation, AdaDelay), ``TurnSchedule`` (a
deterministic order of worker turns for exact reference tests).
"""
from .client import HIST_BINS, Handle, ParameterServer, servers_from_env
from .rules import COMPENSATIONS, UpdateRule
from .schedule import TurnSchedule

__all__ = ["COMPENSATIONS", "HIST_BINS", "Handle", "ParameterServer", "TurnSchedule", "UpdateRule",
           "servers_from_env"]
