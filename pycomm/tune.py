"""``pycomm-tune``: measure which allreduce algorithm is fastest at each size, for algorithm="auto".

    pycomm-run -np 4 pycomm-tune                  # writes the table for this topology
    PYCOMM_RANKS_PER_NODE=2 pycomm-run -np 4 pycomm-tune

Each available algorithm (mpi, ring, shm on one node; hierarchical and
hierarchical_master across nodes of equal size) is timed at sizes from 1 KiB
to --max-bytes; the median of the slowest rank decides. The winners become a
table of (largest message in bytes, algorithm) that ``pycomm.init()`` loads
for a job of the same shape (ranks, nodes, ranks per node) from
``$PYCOMM_TUNE_DIR`` (default ``~/.cache/pycomm``). Without a table, "auto"
uses the built-in rule: MPI's Allreduce below 64 KiB, then hierarchical across
nodes, shm on one node, ring otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import List, Optional, Tuple

import torch

TUNE_VERSION = 1


def tune_dir() -> str:
    return os.environ.get("PYCOMM_TUNE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pycomm")


def table_path(topo) -> str:
    return os.path.join(tune_dir(), f"tune-{topo.size}ranks-{topo.num_nodes}nodes-{topo.local_size}pernode.json")


def available_algorithms(topo) -> List[str]:
    algos = ["mpi", "ring"]
    if topo.num_nodes == 1 and topo.size > 1:
        algos.append("shm")
    if topo.num_nodes > 1 and topo.homogeneous:
        algos += ["hierarchical", "hierarchical_master"]
    return algos


def load_table(topo) -> Optional[List[Tuple[int, str]]]:
    """The stored table for this topology, or None. A stale or foreign file is ignored."""
    path = table_path(topo)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if data.get("version") != TUNE_VERSION or data.get("virtual_nodes") != topo.virtual_nodes:
        return None
    allowed = set(available_algorithms(topo))
    table = [(int(b), str(a)) for b, a in data.get("table", [])]
    if not table or any(a not in allowed for _, a in table):
        return None
    return table


def crossover_table(best: List[Tuple[int, str]]) -> List[Tuple[int, str]]:
    """[(size, winner)] sorted by size -> [(largest size, algorithm)], merging neighbours
    with the same winner; the last entry covers every larger message."""
    table: List[Tuple[int, str]] = []
    for size, algo in sorted(best):
        if table and table[-1][1] == algo:
            table[-1] = (size, algo)
        else:
            table.append((size, algo))
    if table:
        table[-1] = (2 ** 62, table[-1][1])
    return table


def measure(algorithm: str, nbytes: int, iters: int, comm) -> float:
    import pycomm
    from mpi4py import MPI

    x = torch.ones(max(1, nbytes // 4))
    pycomm.allreduce(x, algorithm=algorithm)  # warm-up: windows and buffers
    times = []
    for _ in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        pycomm.allreduce(x, algorithm=algorithm)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pycomm-tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=int, default=1 << 10)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--dry-run", action="store_true", help="print the table, do not store it")
    args = p.parse_args(argv)

    import pycomm
    from mpi4py import MPI

    topo = pycomm.init()
    comm = MPI.COMM_WORLD
    algos = available_algorithms(topo)
    best, rows = [], []
    size = args.min_bytes
    while size <= args.max_bytes:
        iters = max(3, min(args.iters * 4, int(args.iters * (1 << 22) / size))) if size < (1 << 22) else args.iters
        timing = {a: measure(a, size, iters, comm) for a in algos}
        winner = min(timing, key=timing.get)
        best.append((size, winner))
        rows.append(dict(size=size, times_us={a: t * 1e6 for a, t in timing.items()}, winner=winner))
        if comm.rank == 0:
            print(f"{size:>12} B  " + "  ".join(f"{a} {t * 1e6:9.1f} us" for a, t in timing.items())
                  + f"  -> {winner}", flush=True)
        size *= 4
    table = crossover_table(best)
    if comm.rank == 0:
        print("auto table:", ", ".join(f"<= {b} B: {a}" for b, a in table))
        if not args.dry_run:
            path = table_path(topo)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(dict(version=TUNE_VERSION, virtual_nodes=topo.virtual_nodes, ranks=topo.size,
                               nodes=topo.num_nodes, local_size=topo.local_size, table=table, rows=rows), f, indent=1)
            print(f"stored in {path}; pycomm.init() loads it for jobs of this shape")
    pycomm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
