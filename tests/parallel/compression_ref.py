"""numpy reference of the two-phase 1-bit compressed allreduce (docs/algorithms.md §2).

Written from the math, not from pycomm's code: float32 arithmetic where the
scheme specifies float32, the sum of squares in float64.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

F32 = np.float32


def layout(n: int, world: int):
    """(padded, chunk): n padded to a multiple of 8*world, chunk = padded / world."""
    unit = 8 * world
    padded = -(-n // unit) * unit
    return padded, padded // world


def chunk_range(n: int, world: int, j: int):
    _, m = layout(n, world)
    b = min(n, j * m)
    return b, min(n, b + m)


def quantize(x: np.ndarray, e: np.ndarray, kept: np.ndarray):
    """c = x + e; s = ||c_kept|| / sqrt(#kept); bit = c >= 0; e' = c - q (0 where masked).

    Returns (positive, scale, new residual, c)."""
    c = (x.astype(F32) + e.astype(F32)).astype(F32)
    k = int(kept.sum())
    s = F32(np.sqrt(np.sum(c[kept].astype(np.float64) ** 2) / k)) if k else F32(0)
    pos = c >= 0
    q = np.where(pos, s, -s).astype(F32)
    q[~kept] = 0
    e_new = (c - q).astype(F32)
    e_new[~kept] = 0
    return pos, s, e_new, c


def dequantize(pos: np.ndarray, s, kept: np.ndarray) -> np.ndarray:
    q = np.where(pos, F32(s), -F32(s)).astype(F32)
    q[~kept] = 0
    return q


def two_phase(xs: Sequence[np.ndarray], worker_res: Sequence[np.ndarray], server_res: Sequence[np.ndarray],
              average: bool = True, mask: Optional[np.ndarray] = None, weight: Optional[float] = None):
    """One compressed allreduce of every rank's x.

    xs[k], worker_res[k]: rank k's input and worker residual (n floats);
    server_res[j]: rank j's server residual (chunk floats).
    weight: the server's factor on each rank's term; default 1/world for an
    average, 1 for a sum (the hierarchical form passes 1/(all ranks)).
    Returns (result, new worker residuals, new server residuals, ambiguous)
    where `ambiguous` marks elements whose server-side value was so close to
    zero (|c| <= 1e-5 s) that its sign is decided by rounding.
    """
    world = len(xs)
    n = xs[0].size
    _, m = layout(n, world)
    kept_all = np.ones(n, bool) if mask is None else mask.astype(bool)
    new_w = [np.array(w, dtype=F32, copy=True) for w in worker_res]
    new_s = [np.array(s, dtype=F32, copy=True) for s in server_res]
    result = np.zeros(n, F32)
    ambiguous = np.zeros(n, bool)
    # phase 1: every worker quantizes every chunk with its own scale
    bits = [[None] * world for _ in range(world)]
    scales = np.zeros((world, world), F32)
    for k in range(world):
        for j in range(world):
            b, e = chunk_range(n, world, j)
            pos, s, en, _ = quantize(xs[k][b:e], worker_res[k][b:e], kept_all[b:e])
            bits[k][j], scales[k, j] = pos, s
            new_w[k][b:e] = en
    if weight is None:
        weight = F32(1) / F32(world) if average else F32(1)
    weight = F32(weight)
    for j in range(world):
        b, e = chunk_range(n, world, j)
        kept = kept_all[b:e]
        acc = np.zeros(e - b, F32)
        for k in range(world):  # in rank order, float32
            acc = (acc + dequantize(bits[k][j], F32(weight * scales[k, j]), kept)).astype(F32)
        pos, s, en, c = quantize(acc, server_res[j][: e - b], kept)
        new_s[j][: e - b] = en
        result[b:e] = dequantize(pos, s, kept)
        ambiguous[b:e] = (np.abs(c) <= F32(1e-5) * s) & kept
    return result, new_w, new_s, ambiguous


def fp16_bound(xs: Sequence[np.ndarray], eps: float) -> np.ndarray:
    """Error bound of the pre-divided half-precision average: N roundings of partial sums plus the casts."""
    world = len(xs)
    mag = np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0) / world
    return 2 * (world + 1) * eps * mag + 1e-30


def node_sums(xs: Sequence[np.ndarray], ranks_per_node: int) -> List[np.ndarray]:
    """Each node's float32 sum of its ranks' inputs, in the order pycomm's shm
    reduction adds them: slice l (of ranks_per_node near-equal slices) starts
    from local rank l's values and adds local ranks l+1, l+2, ... (wrapping)."""
    n = xs[0].size
    L = ranks_per_node
    bounds = [l * (n // L) + min(l, n % L) for l in range(L + 1)]
    sums = []
    for node in range(len(xs) // L):
        local = [np.asarray(xs[node * L + l], F32) for l in range(L)]
        total = np.empty(n, F32)
        for l in range(L):
            b, e = bounds[l], bounds[l + 1]
            acc = local[l][b:e].copy()
            for k in range(1, L):
                acc = (acc + local[(l + k) % L][b:e]).astype(F32)
            total[b:e] = acc
        sums.append(total)
    return sums


def cross_stages(xs: Sequence[np.ndarray], num_nodes: int, local_size: int, homogeneous: bool):
    """What pycomm's compressed stage sees. Across nodes of equal size with several ranks each (the
    hierarchical form): slice l of every node's float32 sum, among the ranks with local rank l;
    otherwise (one node, nodes of one rank, nodes of different sizes) the flat form: every rank's input
    among all. Yields (begin, end, member ranks, their inputs for [begin, end))."""
    n = xs[0].size
    if num_nodes > 1 and homogeneous and local_size > 1:
        L, M = local_size, num_nodes
        sums = node_sums(xs, L)
        for l in range(L):
            b, e = l * (n // L) + min(l, n % L), (l + 1) * (n // L) + min(l + 1, n % L)
            yield b, e, [k * L + l for k in range(M)], [sums[k][b:e] for k in range(M)]
    else:
        yield 0, n, list(range(len(xs))), list(xs)


def onebit_model(xs, worker_res, server_res, average, mask, num_nodes, local_size, homogeneous):
    """two_phase() on the stages pycomm runs (cross_stages), with the average's weight 1/(all ranks).
    Residuals in their flat shapes (worker n, server layout(n, world) chunk). Returns (result, new
    worker residuals, new server residuals, ambiguous) like two_phase()."""
    n, world = xs[0].size, len(xs)
    result, ambiguous = np.zeros(n, F32), np.zeros(n, bool)
    new_w = [np.array(w, F32, copy=True) for w in worker_res]
    new_s = [np.array(v, F32, copy=True) for v in server_res]
    for b, e, members, inputs in cross_stages(xs, num_nodes, local_size, homogeneous):
        _, chunk = layout(e - b, len(members))
        r, nw, ns, amb = two_phase(inputs, [worker_res[m][b:e] for m in members],
                                   [server_res[m][:chunk] for m in members], average=average,
                                   mask=None if mask is None else mask[b:e],
                                   weight=F32(1.0 / world) if average else F32(1.0))
        result[b:e], ambiguous[b:e] = r, amb
        for i, m in enumerate(members):
            new_w[m][b:e], new_s[m][:chunk] = nw[i], ns[i]
    return result, new_w, new_s, ambiguous
