"""hvd.DistributedOptimizer over pycomm.DistributedOptimizer.

Horovod's signature and defaults; the gradient reduction is pycomm's
(buckets reduced while backward runs, ``synchronize()``,
``skip_synchronize()``, ``backward_passes_per_step`` with locally summed
gradients). Differences from Horovod, all raised rather than ignored:
``op=hvd.Adasum`` (NotImplementedError), ``groups``/``num_groups`` (pycomm
buckets by size: ``bucket_mb``). ``process_set`` reduces over that set (ranks
outside it keep their local gradients); sparse gradients follow
``sparse_as_dense`` as in Horovod.
``gradient_predivide_factor`` f (Average only, as in Horovod) only moves
where Horovod divides (by f before the sum, by N/f after it) to keep fp16
sums in range; the result is the average either way. pycomm's average
already divides half-precision buffers by N before summing, so f is
validated and recorded but changes no value.
"""
from __future__ import annotations

import warnings

import torch

import pycomm

from .compression import Compression, pycomm_compression
from .mpi_ops import Adasum, Average, Sum, _OP_NAMES
from .process_sets import _group, global_process_set


class _HorovodDistributedOptimizer(pycomm.DistributedOptimizer):
    """pycomm.DistributedOptimizer that records Horovod's gradient_predivide_factor."""

    def __init__(self, optimizer, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, **kwargs):
        super().__init__(optimizer, named_parameters, compression=compression,
                         backward_passes_per_step=backward_passes_per_step, op=op, **kwargs)
        self.gradient_predivide_factor = float(gradient_predivide_factor)

    @property
    def _parameter_names(self):
        """{parameter: name} as Horovod's optimizer has it (named by position without named_parameters)."""
        return {p: self._names[id(p)] for g in self.param_groups for p in g["params"] if id(p) in self._names}

    def step(self, closure=None):
        if self._synchronized and not self._skip_sync:
            # Horovod's warning, word for word: its users look for it.
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                          "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
                          "code.")
        return super().step(closure)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=global_process_set,
                         **pycomm_options):
    """Wrap a torch optimizer so that step() applies gradients averaged (or summed) over all ranks.

    Extra keyword arguments go to pycomm.DistributedOptimizer (bucket_mb, algorithm).
    """
    if op == Adasum:
        raise NotImplementedError("hvd.DistributedOptimizer: op=hvd.Adasum is not implemented by pycomm; use "
                                  "hvd.Average or hvd.Sum")
    if op not in (Average, Sum):
        raise ValueError(f"hvd.DistributedOptimizer: op must be hvd.Average or hvd.Sum, got "
                         f"{_OP_NAMES.get(op, op)!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("hvd.DistributedOptimizer: gradient_predivide_factor needs op=hvd.Average")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"hvd.DistributedOptimizer: gradient_predivide_factor must be positive, got "
                         f"{gradient_predivide_factor!r}")
    if num_groups or groups is not None:
        raise ValueError("hvd.DistributedOptimizer: num_groups/groups are not supported; pycomm fuses gradients "
                         "into buckets by size (pass bucket_mb=)")
    group = _group(process_set, "DistributedOptimizer")  # None: all ranks
    return _HorovodDistributedOptimizer(
        optimizer, named_parameters, pycomm_compression(compression, "DistributedOptimizer"),
        backward_passes_per_step, "avg" if op == Average else "sum", gradient_predivide_factor,
        group=group, sparse_as_dense=sparse_as_dense, **pycomm_options)
