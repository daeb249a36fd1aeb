"""Small-message latency: a blocking pycomm.allreduce against MPI's Allreduce (mpi4py), same run.

    pycomm-run -np 2 python bench/latency.py --reps 9

Each repetition times a loop of `--calls` blocking calls of each kind back to
back (pycomm.allreduce with the defaults -- algorithm auto, the agreement
check on -- then comm.Allreduce on a numpy array of the same bytes), after a
barrier; a call's time is the loop's time over `--calls` on the slowest rank.
Loops instead of single calls, because a single 4 KiB call is shorter than
the timer's and the barrier's noise. Prints the median over repetitions of
each, pycomm - MPI (the median of the per-repetition differences, so a
repetition slowed by another job on the machine moves both sides) and the
interquartile range of those differences.
"""
import argparse
import statistics
import time

import numpy as np
import torch

import pycomm


def loop_us(fn, calls, comm):
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return comm.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4096", help="bytes, comma-separated (float32 tensors)")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    p.add_argument("--reps", type=int, default=9, help="timed loops of each kind (the median is reported)")
    p.add_argument("--algorithm", default="auto")
    args = p.parse_args(argv)
    pycomm.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    opts = pycomm.get_options()
    if comm.rank == 0:
        print(f"# {comm.size} ranks; blocking allreduce (float32, op sum, algorithm {args.algorithm}, "
              f"check_consistency={opts['check_consistency']}); {args.calls} calls a loop, median of {args.reps} "
              f"loops; us per call, slowest rank")
        print(f"  {'bytes':>7} {'pycomm':>8} {'mpi4py':>8} {'pycomm - mpi4py':>16} {'IQR of diff':>12} "
              f"{'pycomm / mpi4py':>16}")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = torch.ones(nbytes // 4)
        a = np.ones(nbytes // 4, dtype=np.float32)
        ours, base = [], []

        def run_ours():
            pycomm.allreduce(x, algorithm=args.algorithm)

        def run_base():
            comm.Allreduce(MPI.IN_PLACE, a)

        loop_us(run_ours, args.calls // 10 + 1, comm)  # warm up (shm window, caches)
        loop_us(run_base, args.calls // 10 + 1, comm)
        for _ in range(args.reps):
            ours.append(loop_us(run_ours, args.calls, comm))
            base.append(loop_us(run_base, args.calls, comm))
        diff = [o - b for o, b in zip(ours, base)]
        q = statistics.quantiles(diff, n=4) if len(diff) > 1 else [diff[0]] * 3
        if comm.rank == 0:
            mo, mb = statistics.median(ours), statistics.median(base)
            print(f"  {nbytes:>7} {mo:>8.2f} {mb:>8.2f} {statistics.median(diff):>+16.2f} {q[2] - q[0]:>12.2f} "
                  f"{mo / mb:>15.2f}x")
    pycomm.shutdown()


if __name__ == "__main__":
    main()
