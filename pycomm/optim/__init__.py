"""Optimizers for large-batch and communication-efficient data-parallel training.

- LARS, LAMB: layer-wise adaptive optimizers (use with pycomm.DistributedOptimizer).
- MixedPrecision: half-precision model, float32 master weights, dynamic loss scaling agreed across ranks.
- OneBitAdam, OneBitLAMB: the whole data-parallel step, with 1-bit compressed momentum after warm-up.

pycomm.optim builds on pycomm's core (runtime, collectives, compression); the core never imports it.
"""
from .lamb import LAMB
from .lars import LARS
from .mixed_precision import MixedPrecision
from .onebit_adam import OneBitAdam
from .onebit_lamb import OneBitLAMB
from ._common import exclude_1d

__all__ = ["LAMB", "LARS", "MixedPrecision", "OneBitAdam", "OneBitLAMB", "exclude_1d"]
