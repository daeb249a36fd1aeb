"""What one small allreduce costs the caller, per call, through each face of pycomm.

    pycomm-run -np 2 python bench/submit_cost.py [--tensors 400] [--reps 15] [--rounds 2]

400 tensors of 1-4 KiB (float32, the latency-bound model of bench/fusion.py), named once. Each row
is a step over all of them, timed on the slowest rank, median of --reps steps:

- submit: the loop of asynchronous calls alone (us a call), the first handle's wait (us: the fused
  batch, run by the waiting thread itself when the engine's worker has not taken it yet), then the
  whole step with every handle waited for (ms);
- blocking: one blocking call per tensor (ms for the 400).

Rows: pycomm.allreduce_async (a C function, csrc/bindings/allreduce_entry.cpp) / pycomm.allreduce;
the pybind11 binding pycomm._C.allreduce_async called directly (the checked submission both reach);
pycomm.horovod's allreduce_async_ / allreduce_ (hvd.Average, Horovod's default). Each round runs every
row once, in this order. The pycomm rows run with pycomm's default pairing (by submission order), the
hvd rows with hvd.init()'s pair_by_name (Horovod's rule: named operations pair by name).
"""
from __future__ import annotations

import argparse
import random
import time

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=400)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)

    import pycomm
    import pycomm.horovod as hvd
    from pycomm import _C

    hvd.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rng = random.Random(0)
    grads = [torch.randn(rng.randint(256, 1024)) for _ in range(args.tensors)]
    names = [f"grad.{i}" for i in range(args.tensors)]
    n = len(grads)

    def timed(submit, finish):
        """(median us a call of `submit`, median us of the first handle's finish, median ms of submit +
        finish), slowest rank."""
        subs, firsts, steps = [], [], []
        for _ in range(args.reps + 1):  # the first step warms up
            comm.Barrier()
            t0 = time.perf_counter()
            handles = submit()
            t1 = time.perf_counter()
            finish(handles[:1])
            t2 = time.perf_counter()
            finish(handles[1:])
            t3 = time.perf_counter()
            subs.append(comm.allreduce(t1 - t0, op=MPI.MAX))
            firsts.append(comm.allreduce(t2 - t1, op=MPI.MAX))
            steps.append(comm.allreduce(t3 - t0, op=MPI.MAX))
        median = lambda xs: sorted(xs[1:])[(len(xs) - 1) // 2]
        return median(subs) * 1e6 / n, median(firsts) * 1e6, median(steps) * 1e3

    def wait_all(handles):
        for h in handles:
            h.wait()

    def sync_all(handles):
        for h in handles:
            hvd.synchronize(h)

    def nothing(_):
        pass

    rows = {
        "pycomm.allreduce_async": (lambda: [pycomm.allreduce_async(g, op="avg", name=m) for g, m in zip(grads, names)],
                                   wait_all),
        "_C.allreduce_async": (lambda: [_C.allreduce_async(g, g, "sum", True, "auto", m, False, 0)
                                        for g, m in zip(grads, names)], wait_all),
        "pycomm.allreduce": (lambda: [pycomm.allreduce(g, op="avg", name=m) for g, m in zip(grads, names)], nothing),
        "hvd.allreduce_async_": (lambda: [hvd.allreduce_async_(g, name=m) for g, m in zip(grads, names)], sync_all),
        "hvd.allreduce_": (lambda: [hvd.allreduce_(g, name=m) for g, m in zip(grads, names)], nothing),
    }
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {n} tensors of 1-4 KiB (float32, average), median of {args.reps} steps, "
              f"slowest rank")
        print(f"{'round':>5}  {'call':<24} {'us a call (submit)':>18} {'us first wait':>13} {'ms a step':>10}")
    for r in range(args.rounds):
        for label, (submit, finish) in rows.items():
            pycomm.set_options(pair_by_name=label.startswith("hvd."))  # collective: every rank, same point
            per_call, first, step = timed(submit, finish)
            if comm.rank == 0:
                blocking = label in ("pycomm.allreduce", "hvd.allreduce_")
                print(f"{r + 1:>5}  {label:<24} {'(blocking)' if blocking else f'{per_call:.2f}':>18} "
                      f"{'' if blocking else f'{first:.1f}':>13} {step:>10.3f}")


if __name__ == "__main__":
    main()
