"""A short allreduce bandwidth table printed at the end of a training run (nccl-tests columns).

time_us is the median over calls of the slowest rank's time; algbw = S / t;
busbw = algbw * 2(N-1)/N (ALGORITHMS.md §1).
"""
from __future__ import annotations

from typing import List

import torch

import pycomm
from pycomm.benchmark import bandwidth, median_time

DEFAULT_SIZES = (4 << 10, 256 << 10, 4 << 20)


def measure(sizes=DEFAULT_SIZES, algorithms=("auto", "ring", "mpi"), iters: int = 5, warmup: int = 1) -> List[dict]:
    """Collective: every rank calls it with the same arguments."""
    from mpi4py import MPI

    n = pycomm.size()
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        x = torch.ones(count, dtype=torch.float32)
        for algo in algorithms:
            t = median_time(lambda: pycomm.allreduce(x, op="avg", algorithm=algo), MPI.COMM_WORLD, iters, warmup,
                            before=lambda: x.fill_(1.0))
            wrong = MPI.COMM_WORLD.allreduce(int((x != 1.0).sum()), op=MPI.SUM)
            algbw, busbw = bandwidth(nbytes, t, n)
            rows.append({"size": nbytes, "count": count, "type": "float", "algorithm": algo,
                         "time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": busbw, "wrong": wrong})
    return rows


def format_table(rows: List[dict], world_size: int) -> str:
    lines = [f"allreduce bandwidth, {world_size} rank(s), op avg",
             f"{'size(B)':>10} {'count':>9} {'type':>6} {'algo':>5} {'time(us)':>10} {'algbw(GB/s)':>12} "
             f"{'busbw(GB/s)':>12} {'#wrong':>7}"]
    for r in rows:
        lines.append(f"{r['size']:>10} {r['count']:>9} {r['type']:>6} {r['algorithm']:>5} {r['time_us']:>10.1f} "
                     f"{r['algbw_GBps']:>12.3f} {r['busbw_GBps']:>12.3f} {r['wrong']:>7}")
    return "\n".join(lines)
