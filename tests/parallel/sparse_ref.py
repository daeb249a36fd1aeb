"""numpy reference of top-k / threshold sparsification with error feedback (docs/algorithms.md §5b).

acc = x + e in float32 (one rounding, as specified); the K largest |acc| with ties to the lower
index are sent; e <- acc with those set to 0; the result is the float64 sum (or mean) of every
rank's sent values at their indices.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def select(acc: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the k largest |acc|, ties to the lower index."""
    order = np.lexsort((np.arange(acc.size), -np.abs(acc.astype(np.float64))))
    return np.sort(order[:k])


def sparse_step(xs: Sequence[np.ndarray], es: Sequence[np.ndarray], k: int, average: bool = True):
    """Returns (result float64, new residuals float32 per rank)."""
    n = xs[0].size
    result = np.zeros(n)
    new_es = []
    for x, e in zip(xs, es):
        acc = (x.astype(np.float32) + e.astype(np.float32)).astype(np.float32)
        idx = select(acc, k)
        np.add.at(result, idx, acc[idx].astype(np.float64))
        acc = acc.copy()
        acc[idx] = 0
        new_es.append(acc)
    if average and len(xs):
        result /= len(xs)
    return result, new_es


def threshold_k(xs, es, value: float) -> int:
    """K = max over ranks of #{|x + e| >= value}."""
    return max(int(np.sum(np.abs((x.astype(np.float32) + e.astype(np.float32)).astype(np.float32)) >= value))
               for x, e in zip(xs, es))
