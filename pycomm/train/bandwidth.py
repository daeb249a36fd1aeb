"""A short allreduce bandwidth table printed at the end of a training run (nccl-tests columns).

time_us is the slowest rank's mean time per call; algbw = S / t;
busbw = algbw * 2(N-1)/N (ALGORITHMS.md §1).
"""
from __future__ import annotations

import time
from typing import List

import torch

import pycomm

DEFAULT_SIZES = (4 << 10, 256 << 10, 4 << 20)


def measure(sizes=DEFAULT_SIZES, algorithms=("ring", "mpi"), iters: int = 5, warmup: int = 1) -> List[dict]:
    """Collective: every rank calls it with the same arguments."""
    n = pycomm.size()
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        x = torch.ones(count, dtype=torch.float32)
        for algo in algorithms:
            for _ in range(warmup):
                pycomm.allreduce(x, op="sum", algorithm=algo)
            x.fill_(1.0)
            pycomm.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                pycomm.allreduce(x, op="avg", algorithm=algo)
            dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            pycomm.allreduce(dt, op="max", algorithm="mpi")
            wrong = int((x != 1.0).sum())
            wrong_t = torch.tensor([wrong], dtype=torch.int64)
            pycomm.allreduce(wrong_t, op="sum", algorithm="mpi")
            t = float(dt.item())
            algbw = nbytes / t / 1e9 if t > 0 else 0.0
            rows.append({"size": nbytes, "count": count, "type": "float", "algorithm": algo,
                         "time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n,
                         "wrong": int(wrong_t.item())})
    return rows


def format_table(rows: List[dict], world_size: int) -> str:
    lines = [f"allreduce bandwidth, {world_size} rank(s), op avg",
             f"{'size(B)':>10} {'count':>9} {'type':>6} {'algo':>5} {'time(us)':>10} {'algbw(GB/s)':>12} "
             f"{'busbw(GB/s)':>12} {'#wrong':>7}"]
    for r in rows:
        lines.append(f"{r['size']:>10} {r['count']:>9} {r['type']:>6} {r['algorithm']:>5} {r['time_us']:>10.1f} "
                     f"{r['algbw_GBps']:>12.3f} {r['busbw_GBps']:>12.3f} {r['wrong']:>7}")
    return "\n".join(lines)
