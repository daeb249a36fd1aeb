"""Parameter-server throughput: push+pull of a whole model against the ring allreduce of the same bytes.

    pycomm-run -np 4 python bench/ps.py [--min-bytes 1M] [--max-bytes 64M] [--iters 5] [--json out.json]

For each size S (one float32 tensor) and each placement (co-located: every
rank a worker and a server; dedicated: the last rank only serves, the others
work), every worker pushes S bytes of gradient and pulls the S bytes of
weights back, all workers at once; time_us is the median over iterations of
the slowest worker (push, pull and their replies, the servers' SGD update
included). Columns:
  GB/s     wire bytes per worker / time: co-located, a worker sends (K-1)/K S and receives (K-1)/K S
           (its own shard stays in process), like the ring's 2(N-1)/N S: so this is busbw-comparable;
           dedicated, the worker sends and receives all of S: 2S / t.
  upd/s    updates applied per second over all servers (W pushes of K shards per iteration).
  ring busbw and ratio: pycomm's ring allreduce of the same S on all ranks, timed in the same run
           (nccl-tests busbw = S/t * 2(N-1)/N); ratio = PS GB/s / ring busbw.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import pycomm
from pycomm.benchmark import bandwidth, median_time
from pycomm.ps import ParameterServer, UpdateRule

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    unit = text[-1] if text and text[-1] in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


def human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def time_ps(nbytes: int, servers: int, iters: int):
    """Median seconds per push+pull iteration (slowest worker); None on dedicated server ranks."""
    from mpi4py import MPI

    ps = ParameterServer(UpdateRule(lr=1e-9), servers=servers)
    if not ps.is_worker:
        ps.serve()
        return None, ps
    n = nbytes // 4
    w = torch.zeros(n)
    g = torch.ones(n)
    ps.register({"w": w})
    times = []
    for i in range(iters + 1):
        ps.worker_comm.Barrier()
        t0 = time.perf_counter()
        h = ps.push_async("w", g)
        ps.pull("w", w)
        h.wait()
        dt = ps.worker_comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i:
            times.append(dt)
    ps.shutdown()
    return statistics.median(times), ps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-bytes", default="1M")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    pycomm.init()
    N, rank = pycomm.size(), pycomm.rank()
    lo, hi = parse_size(a.min_bytes), parse_size(a.max_bytes)
    placements = [("co-located", 0)] + ([("dedicated", 1)] if N >= 2 else [])
    rows = []
    s = lo
    while s <= hi:
        x = torch.ones(s // 4)
        t_ring = median_time(lambda: pycomm.allreduce(x, op="sum", algorithm="ring"), pycomm.world_comm(), a.iters)
        _, ring_bus = bandwidth(s, t_ring, N)
        for label, k in placements:
            t, ps = time_ps(s, k, a.iters)
            t = pycomm.world_comm().bcast(t, root=0)  # rank 0 is always a worker
            K, W = ps.num_servers, ps.num_workers
            wire = 2 * s * (K - 1) / K if k == 0 else 2 * s
            gbps = wire / t / 1e9
            rows.append({"size": s, "placement": label, "workers": W, "servers": K, "time_us": t * 1e6,
                         "GBps": gbps, "updates_per_s": W * K / t, "ring_time_us": t_ring * 1e6,
                         "ring_busbw_GBps": ring_bus, "ratio": gbps / ring_bus if ring_bus else float("nan")})
        s *= a.factor
    if rank == 0:
        print(f"pycomm.ps push+pull, {N} ranks, float32, median of {a.iters} (slowest worker)")
        print(f"{'size':>9} {'placement':>11} {'W':>2} {'K':>2} {'time_us':>10} {'GB/s':>7} {'upd/s':>9} "
              f"{'ring_us':>10} {'ring busbw':>10} {'ratio':>6}")
        for r in rows:
            print(f"{human(r['size']):>9} {r['placement']:>11} {r['workers']:>2} {r['servers']:>2} "
                  f"{r['time_us']:>10.0f} {r['GBps']:>7.2f} {r['updates_per_s']:>9.0f} {r['ring_time_us']:>10.0f} "
                  f"{r['ring_busbw_GBps']:>10.2f} {r['ratio']:>5.2f}x")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
