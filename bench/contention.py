"""Allreduce under CPU contention: every algorithm, interleaved repetitions.

    python bench/contention.py                       # both scenarios, then the table
    python bench/contention.py --scenarios neighbour --reps 10 --json out.json

Not run under pycomm-run: it launches its own jobs through pycomm's launcher
(python -m pycomm.tools.launcher), one per scenario:

- oversubscribed: `--ranks-over` ranks (4) on this machine's cores (2 here),
  so the launcher adds --oversubscribe and mpi_yield_when_idle;
- neighbour: `--ranks-neighbour` ranks (2) beside one CPU-bound process (a
  Python busy loop started here, which ends itself after --neighbour-s seconds
  and is killed when the job ends, whichever comes first).

In each job, for every size, `--reps` repetitions; a repetition times every
algorithm once, in an order rotated by one every repetition, each a loop of
calls after a barrier (the slowest rank's time over the calls; the calls per
loop are fixed per size from one warm call of each algorithm, --loop-ms). Per algorithm
the table gives the median over repetitions and the slowest repetition over
the median; for auto, its time over the best algorithm's time in the same
repetition: the median of that ratio and in how many repetitions it is within
--within (15%). auto runs the built-in rule (auto_table emptied, as
bench/auto_regret.py --table builtin) unless --table stored.

The last row of each size is a control: the algorithm auto chose, timed a second
time in every repetition (its own loop in the rotation), with auto's two columns
worked out for it in auto's place (its time over the best of ring, mpi, shm and
itself). auto and that algorithm run the same code, so the control's count is
what this machine's noise alone allows auto's count to reach.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = "16K,1M,16M,64M"
ALGORITHMS = ("ring", "mpi", "shm", "auto")
AGAIN = "again"  # the control: auto's choice timed a second time (module docstring)


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def human(n):
    for unit, b in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= b:
            return f"{n // b} {unit}"
    return f"{n} B"


def worker(args):
    import torch

    import pycomm

    pycomm.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if args.table == "builtin":
        pycomm.set_options(auto_table=[])
    rows = []
    for nbytes in (parse_bytes(s) for s in args.sizes.split(",")):
        x = torch.ones(nbytes // 4)
        one = 0.0
        for alg in ALGORITHMS:  # warm-up (windows, receive slots, caches), then one timed call each
            pycomm.allreduce(x, algorithm=alg)
            comm.Barrier()
            t0 = time.perf_counter()
            pycomm.allreduce(x, algorithm=alg)
            one = max(one, time.perf_counter() - t0)
        # Calls per timed loop: about --loop-ms of the slowest algorithm's call, the same for all.
        calls = comm.bcast(max(1, min(200, int(args.loop_ms * 1e-3 / max(one, 1e-9)))), root=0)
        chosen = pycomm.resolve_algorithm("auto", x.numel() * x.element_size())
        timed = ALGORITHMS + (AGAIN,)
        times = {alg: [] for alg in timed}
        for rep in range(args.reps):
            order = timed[rep % len(timed):] + timed[:rep % len(timed)]
            for alg in order:
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    pycomm.allreduce(x, algorithm=chosen if alg == AGAIN else alg)
                times[alg].append(comm.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX) * 1e3)
        rows.append(dict(bytes=nbytes, calls=calls, chosen=chosen, ms=times))
    if comm.rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
    pycomm.shutdown()


def start_neighbour(seconds):
    loop = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", loop])


def run_scenario(name, ranks, args):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "pycomm.tools.launcher", "-np", str(ranks), sys.executable,
               os.path.abspath(__file__), "--worker-out", out, "--sizes", args.sizes, "--reps", str(args.reps),
               "--table", args.table, "--loop-ms", str(args.loop_ms)]
        neighbour = start_neighbour(args.neighbour_s) if name == "neighbour" else None
        load = os.getloadavg()[0]
        # Its own process group, so that a job past the time limit goes with mpirun and every rank.
        job = subprocess.Popen(cmd, stdout=None if args.verbose else subprocess.DEVNULL, start_new_session=True)
        try:
            rc = job.wait(timeout=args.neighbour_s)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            raise SystemExit(f"{name}: the job ran past {args.neighbour_s:.0f} s and was killed")
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        if rc != 0:
            raise SystemExit(f"{name}: the job exited with {rc}")
        with open(out) as f:
            return dict(scenario=name, ranks=ranks, load_before=load, rows=json.load(f))


def against_best(ms, contender):
    """Per repetition, `contender`'s time over the best of ring, mpi, shm and `contender` (auto, or the
    control in auto's place), and the best times themselves."""
    field = [a for a in ALGORITHMS if a != "auto"] + [contender]
    best = [min(ms[a][i] for a in field) for i in range(len(ms[contender]))]
    return [c / b for c, b in zip(ms[contender], best)], best


def summarise(result, within):
    lines = []
    for row in result["rows"]:
        ms = row["ms"]
        _, best = against_best(ms, "auto")
        for alg in ALGORITHMS + (AGAIN,):
            med = statistics.median(ms[alg])
            spread = max(ms[alg]) / med
            if alg in ("auto", AGAIN):
                ratios, field_best = against_best(ms, alg)
                ok = sum(r <= 1 + within for r in ratios)
                auto = f"{statistics.median(ratios):.2f} | {ok}/{len(ratios)}"
                wins = sum(ms[alg][i] == field_best[i] for i in range(len(field_best)))
            else:
                auto = " | "
                wins = sum(ms[alg][i] == best[i] for i in range(len(best)))
            label = f"{row['chosen']} again (control)" if alg == AGAIN else alg
            lines.append(f"| {result['scenario']} ({result['ranks']} ranks) | {human(row['bytes'])} | {row['calls']} | "
                         f"{label} | {med:.3f} | {spread:.2f} | {wins} | {auto} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="oversubscribed,neighbour")
    p.add_argument("--sizes", default=SIZES, help="bytes, comma-separated, K/M/G suffixes (float32 tensors)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--ranks-over", type=int, default=4)
    p.add_argument("--ranks-neighbour", type=int, default=2)
    p.add_argument("--neighbour-s", type=float, default=600.0,
                   help="the neighbour's (and each job's) time limit in seconds")
    p.add_argument("--loop-ms", type=float, default=20.0, help="time of one timed loop of calls, roughly")
    p.add_argument("--within", type=float, default=0.15)
    p.add_argument("--table", choices=("builtin", "stored"), default="builtin")
    p.add_argument("--json", help="write the raw per-repetition times here")
    p.add_argument("--verbose", action="store_true", help="show the jobs' own output")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_out:
        return worker(args)
    results = []
    for name in args.scenarios.split(","):
        ranks = {"oversubscribed": args.ranks_over, "neighbour": args.ranks_neighbour}[name]
        results.append(run_scenario(name, ranks, args))
    print(f"# {os.cpu_count()} cores; ms per allreduce (float32 sum), slowest rank; {args.reps} interleaved "
          f"repetitions; auto from the {'built-in rule' if args.table == 'builtin' else 'stored tune table'}; "
          f"load average before each job: " + ", ".join(f"{r['scenario']} {r['load_before']:.2f}" for r in results))
    print("| scenario | size | calls a loop | algorithm | median ms | max / median | fastest in | auto / best (median) "
          f"| auto within {args.within:.0%} |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for r in results:
        for line in summarise(r, args.within):
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
