"""Regret of algorithm="auto": its time against the fastest algorithm pycomm has, at every size.

    pycomm-run -np 2 python bench/auto_regret.py                    # built-in defaults (no tune table)
    pycomm-run -np 2 pycomm-tune --max-bytes 256M --iters 7 \\
        && pycomm-run -np 2 python bench/auto_regret.py --table stored   # after pycomm-tune

For each size (powers of 4 from --min-bytes to --max-bytes, float32, sum) every
algorithm available on the job's shape (pycomm.tools.tune.available_algorithms) and
`auto` are timed in an interleaved order, --reps samples each; a sample is the
slowest rank's time for `inner` back-to-back blocking calls (more below 4 MiB,
so a sample is long enough to time). Printed per size: the median of each, what
`auto` resolved to, regret = auto / fastest - 1, and the noise: the
interquartile range of the fastest algorithm's samples over their median.

--table builtin: the engine's built-in rule (auto_table emptied); stored: the
table pycomm.init() loaded (rank 0's, see pycomm-tune).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import pycomm
from pycomm.tools.benchmark import slowest_rank_times
from pycomm.tools.tune import available_algorithms


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def human(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def quartiles(xs):
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="256M")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--table", choices=("builtin", "stored"), default="builtin")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.reps < 3:
        p.error("--reps must be at least 3 (medians and quartiles)")

    topo = pycomm.init()
    comm = pycomm.world_comm()
    stored = pycomm.get_options()["auto_table"]
    if args.table == "builtin":
        pycomm.set_options(auto_table=[])
    elif not stored:
        raise SystemExit("--table stored: pycomm.init() found no tune table for this job shape; run pycomm-tune first")
    algos = available_algorithms(topo)
    names = algos + ["auto"]
    rows = []
    if topo.rank == 0:
        table = "built-in defaults" if args.table == "builtin" else \
            "tune table " + ", ".join(f"<= {human(b) if b < 2 ** 60 else 'inf'}: {a}" for b, a in stored)
        print(f"{topo.size} ranks, {topo.num_nodes} node(s); auto from {table}; median of {args.reps} samples, us per call")
        print("| size | " + " | ".join(names) + " | auto runs | fastest | regret | noise (IQR/median of fastest) |")
        print("|---|" + "---:|" * len(names) + "---|---|---:|---:|")
    size = parse_size(args.min_bytes)
    while size <= parse_size(args.max_bytes):
        x = torch.ones(size // 4)
        inner = max(1, min(64, (4 << 20) // size))
        samples = {n: [] for n in names}
        for n in names:  # warm-up: windows and buffers at their size
            pycomm.allreduce(x, algorithm=n)
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotate, so no one always goes first
            for n in order:
                def run(n=n):
                    for _ in range(inner):
                        pycomm.allreduce(x, algorithm=n)
                samples[n] += [t / inner for t in slowest_rank_times(run, comm, iters=1, warmup=0)]
        med = {n: statistics.median(s) for n, s in samples.items()}
        fastest = min(algos, key=med.get)
        regret = med["auto"] / med[fastest] - 1
        q1, q3 = quartiles(samples[fastest])
        noise = (q3 - q1) / med[fastest]
        runs = pycomm.resolve_algorithm("auto", size)
        rows.append(dict(bytes=size, median_us={n: v * 1e6 for n, v in med.items()}, auto_runs=runs,
                         fastest=fastest, regret=regret, noise=noise))
        if topo.rank == 0:
            print(f"| {human(size)} | " + " | ".join(f"{med[n] * 1e6:.1f}" for n in names) +
                  f" | {runs} | {fastest} | {regret * 100:+.1f}% | {noise * 100:.1f}% |", flush=True)
        del x
        size *= 4
    if topo.rank == 0:
        worst = max(rows, key=lambda r: r["regret"])
        print(f"worst regret {worst['regret'] * 100:+.1f}% at {human(worst['bytes'])}; "
              f"sizes within 10%: {sum(r['regret'] <= 0.10 for r in rows)} of {len(rows)}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(ranks=topo.size, table=args.table, rows=rows), f, indent=1)
    pycomm.set_options(auto_table=stored)
    pycomm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
