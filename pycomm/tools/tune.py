"""``pycomm-tune``: measure which allreduce algorithm is fastest at each size, for algorithm="auto".

    pycomm-run -np 4 pycomm-tune                  # writes the table for this topology
    PYCOMM_RANKS_PER_NODE=2 pycomm-run -np 4 pycomm-tune

Each available algorithm (mpi, ring, shm on one node; hierarchical and
hierarchical_master across nodes of equal size) is timed at sizes from 1 KiB
to --max-bytes; the median of the slowest rank decides. The winners become a
table of (largest message in bytes, algorithm) that ``pycomm.init()`` loads
for a job of the same shape (ranks, nodes, ranks per node) from
``$PYCOMM_TUNE_DIR`` (default ``~/.cache/pycomm``). Without a table, "auto"
uses the cost model's winners when pycomm-tune stored the machine's constants
(``machine.json`` beside the tables, for any job shape; pycomm.cost_model),
else the built-in rule (pycomm.resolve_algorithm; docs/allreduce.md).
``--model-only`` measures only the constants.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

# What pycomm.init() reads is in the runtime (pycomm.auto_choice); these are pycomm-tune's names too.
from ..auto_choice import (  # noqa: F401
    TUNE_VERSION,
    available_algorithms,
    load_model,
    load_table,
    model_path,
    table_path,
    tune_dir,
)
from ..cost_model import crossover_table  # noqa: F401 (also pycomm.tools.tune's public name)
from .machine import measure as measure_machine


def measure(algorithm: str, nbytes: int, iters: int, comm) -> float:
    import pycomm
    from .benchmark import median_time

    x = torch.ones(max(1, nbytes // 4))
    return median_time(lambda: pycomm.allreduce(x, algorithm=algorithm), comm, iters, warmup=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pycomm-tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=int, default=1 << 10)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--dry-run", action="store_true", help="print the table, do not store it")
    p.add_argument("--model-only", action="store_true",
                   help="only measure the cost model's constants (alpha, beta, gamma, ...) and store them")
    args = p.parse_args(argv)

    import pycomm
    from mpi4py import MPI

    from .. import cost_model

    topo = pycomm.init()
    comm = MPI.COMM_WORLD
    machine = measure_machine(pycomm.world_comm(), pycomm.local_comm(), topo)
    if comm.rank == 0:
        print("cost model constants: " + ", ".join(f"{k} {v:.3g}" for k, v in machine.to_dict().items()), flush=True)
        if not args.dry_run:
            os.makedirs(tune_dir(), exist_ok=True)
            with open(model_path(), "w") as f:
                json.dump(dict(version=TUNE_VERSION, ranks=topo.size, nodes=topo.num_nodes,
                               constants=machine.to_dict()), f, indent=1)
            print(f"stored in {model_path()}; pycomm.init() builds auto's table from it for job shapes "
                  "without a measured table")
    if args.model_only:
        pycomm.shutdown()
        return 0
    algos = available_algorithms(topo)
    shm_chunk, shm_chunked_above = cost_model.shm_pipeline(topo.local_size)
    best, rows = [], []
    size = args.min_bytes
    while size <= args.max_bytes:
        iters = max(3, min(args.iters * 4, int(args.iters * (1 << 22) / size))) if size < (1 << 22) else args.iters
        timing = {a: measure(a, size, iters, comm) for a in algos}
        winner = min(timing, key=timing.get)
        best.append((size, winner))
        predicted = {a: cost_model.predict(a, size, machine, topo.size, topo.num_nodes, shm_chunk,
                                           shm_chunked_above) * 1e6 for a in algos}
        rows.append(dict(size=size, times_us={a: t * 1e6 for a, t in timing.items()}, winner=winner,
                         predicted_us=predicted))
        if comm.rank == 0:
            print(f"{size:>12} B  " + "  ".join(f"{a} {t * 1e6:9.1f} us (model {predicted[a]:.1f})"
                                               for a, t in timing.items()) + f"  -> {winner}", flush=True)
        size *= 4
    table = crossover_table(best)
    if comm.rank == 0:
        print("auto table:", ", ".join(f"<= {b} B: {a}" for b, a in table))
        if not args.dry_run:
            path = table_path(topo)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(dict(version=TUNE_VERSION, virtual_nodes=topo.virtual_nodes, ranks=topo.size,
                               nodes=topo.num_nodes, local_size=topo.local_size, table=table, rows=rows,
                               model=machine.to_dict()), f, indent=1)
            print(f"stored in {path}; pycomm.init() loads it for jobs of this shape")
    pycomm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
