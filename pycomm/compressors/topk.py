"""compression="topk": send the ceil(ratio n) largest |gradient + residual| elements (docs/algorithms.md §5b).

Aji & Heafield 2017 (drop 99% of the gradient, keep the rest as a residual);
the exchange and the error feedback are pycomm.compressors._sparse's. K depends
only on n, so every rank already agrees on it: no extra communication.
"""
from __future__ import annotations

import math

from ._sparse import SparseCompressor


class TopK(SparseCompressor):
    """Top-k sparsification with error feedback.

    ratio [0.01]: fraction of the elements each rank sends per call,
    K = ceil(ratio n) (at least 1 for n > 0). Bytes per rank and call with a
    ring allgather: (N - 1) 8 K (an int32 index and a float32 value per
    element) against 2 (N - 1)/N 4 n for float32: below it when
    ratio < 1 / N, i.e. the sparse exchange pays off for small ratios only
    (its cost grows with N; an allreduce's does not).

    State: this rank's residual per tensor name (``state_dict()``; resuming
    continues bitwise). Refuses dtypes other than float32, ops other than
    avg/sum, devices other than CPU/CUDA, calls without ``name``.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01):
        super().__init__()
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"topk: ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    @classmethod
    def from_spec(cls, param: str) -> "TopK":
        try:
            ratio = float(param)
        except ValueError:
            raise ValueError(f"topk: the parameter after ':' is the ratio, a number in (0, 1]; got {param!r}") from None
        return cls(ratio=ratio)

    def k_for(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n))) if n else 0

    def agreed_k(self, x, residual, name) -> int:
        return self.k_for(x.numel())

    def state_dict(self):
        sd = super().state_dict()
        sd["ratio"] = self.ratio
        return sd
