"""Parameter-server throughput: push+pull of a whole model against the ring allreduce of the same bytes.

    pycomm-run -np 4 python bench/ps.py [--min-bytes 1M] [--max-bytes 64M] [--iters 5] [--json out.json]
                                        [--placements co-located,dedicated] [--calls push_pull,push+pull]
                                        [--profile]

For each size S (one float32 tensor) and each placement (co-located: every
rank a worker and a server; dedicated: the last rank only serves, the others
work), every worker pushes S bytes of gradient and pulls the S bytes of
weights back, all workers at once; time_us is the median over iterations of
the slowest worker (push, pull and their replies, the servers' SGD update
included). Two ways to call it, timed in the same run (--calls):
  push_pull  ps.push_pull(name, g, w): one request (the local shard updated and copied out in one pass)
  push+pull  h = ps.push_async(name, g); ps.pull(name, w); h.wait(): two requests
Columns:
  GB/s     bytes moved per worker / time, defined to be comparable with the ring's busbw:
           co-located (K = N servers, one per rank): 2 (N-1)/N S / t. A worker pushes (N-1)/N S to the
           other ranks' servers and pulls (N-1)/N S back from them (its own shard stays in its process),
           2 (N-1)/N S remote bytes in all; the ring allreduce's busbw is 2 (N-1)/N S / t as well
           (nccl-tests: a ring rank sends 2 (N-1)/N S). Both count one direction's bytes per rank.
           dedicated: the worker sends and receives all of S: 2S / t.
  upd/s    updates applied per second over all servers (W pushes of K shards per iteration).
  ring busbw and ratio: pycomm's ring allreduce of the same S on all ranks, timed in the same run
           (nccl-tests busbw = S/t * 2(N-1)/N); ratio = PS GB/s / ring busbw. Co-located, the ring runs
           inside the same loop, before the PS calls of every iteration (ring_us is the median of those);
           dedicated, before the PS rounds.
  paired   co-located: the median over iterations of (PS GB/s / ring busbw) of the same iteration, which
           a load that changes during the run moves less than the ratio of the two medians.
  copy GB/s: one rank's torch copy of S bytes (2 S bytes of memory traffic) / t, timed on every rank at
           once in the same run: the machine's memory-copy rate that every transfer here is bounded by.
--profile sets PYCOMM_PS_PROFILE=1: every server prints where its loop's time went (recv-wait, update
kernel, copies, idle sleep) when it ends, once per size and placement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import pycomm
from pycomm.tools.benchmark import bandwidth, human_size, median_time, parse_size
from pycomm.ps import ParameterServer, UpdateRule

def slowest(comm, fn) -> float:
    """Seconds of fn() on the slowest rank of comm, all starting together."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def time_ps(nbytes: int, servers: int, iters: int, calls, ring_x=None):
    """Per call: the list of seconds per iteration (slowest worker), and the ring allreduce's seconds of
    the same iterations when ring_x is given (co-located: every rank is a worker, so the ring runs between
    the calls of every iteration and load that drifts hits both alike). None on dedicated server ranks."""
    ps = ParameterServer(UpdateRule(lr=1e-9), servers=servers)
    if not ps.is_worker:
        ps.serve()
        return None, None, ps
    n = nbytes // 4
    w = torch.zeros(n)
    g = torch.ones(n)
    ps.register({"w": w})

    def push_then_pull():
        h = ps.push_async("w", g)
        ps.pull("w", w)
        h.wait()

    run = {"push_pull": lambda: ps.push_pull("w", g, w), "push+pull": push_then_pull}
    times = {c: [] for c in calls}
    ring = []
    for i in range(iters + 1):
        if ring_x is not None:
            t = slowest(ps.worker_comm, lambda: pycomm.allreduce(ring_x, op="sum", algorithm="ring"))
            if i:
                ring.append(t)
        for c in calls:
            t = slowest(ps.worker_comm, run[c])
            if i:
                times[c].append(t)
    ps.shutdown()
    return times, ring, ps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-bytes", default="1M")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--placements", default="co-located,dedicated",
                   help="comma-separated: co-located, dedicated")
    p.add_argument("--calls", default="push_pull,push+pull", help="comma-separated: push_pull, push+pull")
    p.add_argument("--profile", action="store_true", help="servers print their time breakdown (PYCOMM_PS_PROFILE=1)")
    a = p.parse_args()
    if a.profile:
        os.environ["PYCOMM_PS_PROFILE"] = "1"
    wanted = [x.strip() for x in a.placements.split(",") if x.strip()]
    bad = [x for x in wanted if x not in ("co-located", "dedicated")]
    if bad or not wanted:
        p.error(f"--placements: {bad or wanted} not among co-located, dedicated")
    calls = [x.strip() for x in a.calls.split(",") if x.strip()]
    if not calls or any(c not in ("push_pull", "push+pull") for c in calls):
        p.error(f"--calls: {calls} not among push_pull, push+pull")
    pycomm.init()
    N, rank = pycomm.size(), pycomm.rank()
    lo, hi = parse_size(a.min_bytes), parse_size(a.max_bytes)
    placements = [(label, k) for label, k in (("co-located", 0), ("dedicated", 1))
                  if label in wanted and (k == 0 or N >= 2)]
    rows = []
    s = lo
    while s <= hi:
        x = torch.ones(s // 4)
        t_ring = median_time(lambda: pycomm.allreduce(x, op="sum", algorithm="ring"), pycomm.world_comm(), a.iters)
        y = torch.empty_like(x)
        t_copy = median_time(lambda: y.copy_(x), pycomm.world_comm(), a.iters)
        copy_gbps = s / t_copy / 1e9
        for label, k in placements:
            times, ring, ps = time_ps(s, k, a.iters, calls, ring_x=x if k == 0 else None)
            times, ring = pycomm.world_comm().bcast((times, ring), root=0)  # rank 0 is always a worker
            K, W = ps.num_servers, ps.num_workers
            wire = 2 * s * (K - 1) / K if k == 0 else 2 * s
            t_base = statistics.median(ring) if ring else t_ring  # co-located: the ring of the same iterations
            _, ring_bus = bandwidth(s, t_base, N)
            for call in calls:
                t = statistics.median(times[call])
                gbps = wire / t / 1e9
                # paired: each iteration's PS rate over the ring's rate in that same iteration
                paired = (statistics.median(wire / tp / bandwidth(s, tr, N)[1] / 1e9
                                            for tp, tr in zip(times[call], ring)) if ring else float("nan"))
                rows.append({"size": s, "placement": label, "call": call, "workers": W, "servers": K,
                             "time_us": t * 1e6, "GBps": gbps, "updates_per_s": W * K / t,
                             "ring_time_us": t_base * 1e6, "ring_busbw_GBps": ring_bus,
                             "ratio": gbps / ring_bus if ring_bus else float("nan"), "paired_ratio": paired,
                             "copy_GBps": copy_gbps})
        s *= a.factor
    if rank == 0:
        print(f"pycomm.ps push+pull, {N} ranks, float32, median of {a.iters} (slowest worker)")
        print(f"{'size':>9} {'placement':>11} {'call':>10} {'W':>2} {'K':>2} {'time_us':>10} {'GB/s':>7} {'upd/s':>9} "
              f"{'ring_us':>10} {'ring busbw':>10} {'ratio':>6} {'paired':>6} {'copy GB/s':>9}")
        for r in rows:
            print(f"{human_size(r['size']):>9} {r['placement']:>11} {r['call']:>10} {r['workers']:>2} {r['servers']:>2} "
                  f"{r['time_us']:>10.0f} {r['GBps']:>7.2f} {r['updates_per_s']:>9.0f} {r['ring_time_us']:>10.0f} "
                  f"{r['ring_busbw_GBps']:>10.2f} {r['ratio']:>5.2f}x "
                  f"{(format(r['paired_ratio'], '5.2f') + 'x') if r['paired_ratio'] == r['paired_ratio'] else '—':>6} "
                  f"{r['copy_GBps']:>9.2f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
