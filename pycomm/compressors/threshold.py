"""compression="threshold": send the elements with |gradient + residual| >= value (docs/algorithms.md §5b).

Strom 2015's threshold filtering with error feedback. Each rank counts its
elements above the threshold, k_r; the ranks agree on K = max_r k_r (one
int64 allreduce, max) so the allgather rows have one size, and every rank sends
its K largest |acc|: all its elements above the threshold, plus, on a rank
with k_r < K, its next largest ones (they travel in room that is paid for
anyway, and leave the residual). K = 0 on every rank sends nothing.
"""
from __future__ import annotations

import math

import torch

from .. import _C, _ops, kernels
from ._sparse import SparseCompressor


class Threshold(SparseCompressor):
    """Threshold sparsification with error feedback.

    value [0.001]: |gradient + residual| at or above which an element is sent.
    The right value depends on the gradients' scale (Strom picked it per
    task); ``last_k(name)`` tells how many elements the last call sent per rank.
    Bytes per rank and call: (N - 1) 8 K for the allgather plus the K agreement
    (one int64 ring allreduce).

    State, resume and refusals as TopK.
    """

    name = "threshold"

    def __init__(self, value: float = 1e-3):
        super().__init__()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"threshold: value must be a finite number >= 0, got {value!r}")
        self.value = float(value)

    @classmethod
    def from_spec(cls, param: str) -> "Threshold":
        try:
            value = float(param)
        except ValueError:
            raise ValueError(f"threshold: the parameter after ':' is the value, a number >= 0; got {param!r}") from None
        return cls(value=value)

    def agreed_k(self, x, residual, name) -> int:
        mine = kernels.sparse_count_above(x, residual, self.value)
        k = torch.tensor([mine], dtype=torch.int64)
        _ops.allreduce_async(k, op="max", name=f"{name}.threshold.k", blocking=True).wait()
        return int(k.item())

    def _agreement_bytes(self, world: int) -> int:
        return int(_C.ring_wire_bytes(1, 8, world, 0))

    def state_dict(self):
        sd = super().state_dict()
        sd["value"] = self.value
        return sd
