"""A short allreduce bandwidth table printed at the end of a training run (nccl-tests columns).

time_us is the median over calls of the slowest rank's time; algbw = S / t;
busbw = algbw * 2(N-1)/N (docs/algorithms.md §1).

#wrong counts result elements (over all ranks) that differ from the known
average. The data depend on the rank -- rank r holds k + r - (N-1)/2 at an
element whose average is k -- so an allreduce that does nothing, or reduces
the wrong ranks, shows up; the values are small half-integers, exact in
float32, so a correct allreduce leaves no element off by more than rounding.
"""
from __future__ import annotations

from typing import List

import torch

import pycomm
from pycomm.tools.benchmark import bandwidth, median_time

DEFAULT_SIZES = (4 << 10, 256 << 10, 4 << 20)


def rank_dependent(count: int, rank: int, world_size: int):
    """(expected average, this rank's data): element i averages to i % 7."""
    expected = (torch.arange(count) % 7).to(torch.float32)
    return expected, expected + (rank - (world_size - 1) / 2)


def count_wrong(result: torch.Tensor, expected: torch.Tensor) -> int:
    # The average of half-integers below 8 over N ranks: sum exact, one rounding
    # in the division (relative 6e-8); a wrong reduction is off by at least 1/(2N).
    return int(((result - expected).abs() > 1e-6 * expected.abs().clamp(min=1.0)).sum())


def measure(sizes=DEFAULT_SIZES, algorithms=("auto", "ring", "mpi"), iters: int = 5, warmup: int = 1) -> List[dict]:
    """Collective: every rank calls it with the same arguments."""
    from mpi4py import MPI

    n = pycomm.size()
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        expected, data = rank_dependent(count, pycomm.rank(), n)
        x = data.clone()
        for algo in algorithms:
            t = median_time(lambda: pycomm.allreduce(x, op="avg", algorithm=algo), MPI.COMM_WORLD, iters, warmup,
                            before=lambda: x.copy_(data))
            wrong = MPI.COMM_WORLD.allreduce(count_wrong(x, expected), op=MPI.SUM)
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
