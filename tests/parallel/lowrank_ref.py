"""numpy float64 reference of one PowerSGD step (docs/algorithms.md §5b), written from the math.

Per 2-D piece M (n x m) of every rank k, with residual E_k and warm-start Q:
M_k <- M_k + E_k; P = mean_k M_k Q; P <- Gram-Schmidt(P); Q' = mean_k M_k^T P;
M_hat = P Q'^T; E_k <- M_k - M_hat. Other pieces (1-D, or r (n + m) >= n m) are averaged
exactly and leave no residual. op "sum" multiplies the result by N.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np


def compressed(shape, rank: int) -> bool:
    numel = int(np.prod(shape)) if len(shape) else 1
    rows = int(shape[0]) if len(shape) else 1
    cols = numel // rows if rows else 0
    r = min(rank, rows, cols)
    return len(shape) >= 2 and r > 0 and r * (rows + cols) < numel


def gram_schmidt(p: np.ndarray) -> np.ndarray:
    p = p.copy()
    for j in range(p.shape[1]):
        for i in range(j):
            p[:, j] -= np.dot(p[:, i], p[:, j]) * p[:, i]
        nrm = np.linalg.norm(p[:, j])
        p[:, j] = p[:, j] / nrm if nrm > 0 else 0.0
    return p


def powersgd_step(xs: Sequence[np.ndarray], es: Sequence[np.ndarray], qs: Sequence[Optional[np.ndarray]],
                  shapes, rank: int, average: bool = True):
    """Returns (result, new residuals per rank, new Q per piece), all float64."""
    world = len(xs)
    accs = [np.asarray(x, np.float64) + np.asarray(e, np.float64) for x, e in zip(xs, es)]
    n = accs[0].size
    result = np.zeros(n)
    new_es = [np.zeros(n) for _ in range(world)]
    new_qs: List[Optional[np.ndarray]] = []
    off = 0
    for i, shape in enumerate(shapes):
        numel = int(np.prod(shape)) if len(shape) else 1
        sl = slice(off, off + numel)
        if not compressed(shape, rank):
            result[sl] = np.mean([a[sl] for a in accs], axis=0) if numel else 0
            new_qs.append(None)
        else:
            rows = int(shape[0])
            ms = [a[sl].reshape(rows, numel // rows) for a in accs]
            q = np.asarray(qs[i], np.float64)
            p = gram_schmidt(np.mean([m @ q for m in ms], axis=0))
            q_new = np.mean([m.T @ p for m in ms], axis=0)
            m_hat = p @ q_new.T
            result[sl] = m_hat.reshape(-1)
            for k in range(world):
                new_es[k][sl] = (ms[k] - m_hat).reshape(-1)
            new_qs.append(q_new)
        off += numel
    if not average:
        result *= world
    return result, new_es, new_qs
