"""Tensor fusion: ResNet-50's 161 gradients and a latency-bound model of 400 tensors of 1-4 KiB,
fused against one call per tensor and against ONE allreduce of the same total bytes (the bound).

    pycomm-run -np 2 python bench/fusion.py [--reps 7] [--models resnet50,small] [--json out.json]

"fused" and "per tensor" submit every gradient asynchronously in backward
order (last layer first) and then wait for all, as DistributedOptimizer does.
"fused" uses the engine's tensor fusion (PYCOMM_FUSION_THRESHOLD,
PYCOMM_CYCLE_TIME_MS); "per tensor" sets the threshold to 0 so each tensor is
its own allreduce. "blocking" is one blocking pycomm.allreduce per tensor.
"grouped" submits the same list in one call,
pycomm.grouped_allreduce (Horovod's grouped_allreduce), and fuses as "fused"
does. Times are medians over repetitions of the slowest rank.
"""
from __future__ import annotations

import argparse
import json

import torch

import pycomm
from pycomm.tools.benchmark import median_time


def resnet50_shapes():
    """Parameter shapes of torchvision's ResNet-50 (161 tensors, 25,557,032 parameters)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


def one_step(grads, names):
    """Every gradient submitted in backward order, then all waited for (as DistributedOptimizer does,
    with its names made once)."""
    handles = [pycomm.allreduce_async(g, op="avg", name=n) for g, n in zip(reversed(grads), reversed(names))]
    for h in handles:
        h.wait()


def blocking_step(grads):
    """The same gradients, one blocking allreduce each (the baseline of asynchronous submission)."""
    for g in reversed(grads):
        pycomm.allreduce(g, op="avg")


def grouped_step(grads):
    """The same gradients, in the same order, in one submission."""
    pycomm.grouped_allreduce(grads[::-1], op="avg", name="grad")


def mlp_shapes():
    """bench/train_throughput.py's MLP (784-1024-1024-10, 1,863,690 parameters, 7.1 MiB): one fused batch
    below the shm pipeline threshold on 2 ranks, so it runs in one pass."""
    return [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]


def small_shapes(n=400, seed=0):
    """A latency-bound model: `n` tensors of 1-4 KiB (256-1024 float32), like a transformer's biases and norms."""
    import random

    rng = random.Random(seed)
    return [(rng.randint(256, 1024),) for _ in range(n)]


def run_model(label, shapes, comm, reps, default_threshold):
    grads = [torch.randn(s) for s in shapes]
    nparams = sum(g.numel() for g in grads)
    flat = torch.randn(nparams)
    results = {}
    names = [f"grad.{i}" for i in range(len(grads))]
    steps = {"fused": lambda: one_step(grads, names), "per tensor": lambda: one_step(grads, names),
             "blocking": lambda: blocking_step(grads), "grouped": lambda: grouped_step(grads),
             "one allreduce": lambda: pycomm.allreduce(flat, op="avg")}
    for mode, threshold in (("fused", default_threshold), ("per tensor", 0), ("blocking", default_threshold),
                            ("grouped", default_threshold), ("one allreduce", default_threshold)):
        pycomm.set_options(fusion_threshold_bytes=threshold)
        fn = steps[mode]
        fn()  # warm-up (window and buffer allocation)
        before = pycomm.stats()
        t = median_time(fn, comm, reps, warmup=0)
        after = pycomm.stats()
        results[mode] = dict(time_ms=t * 1e3, rounds_per_step=(after["rounds"] - before["rounds"]) / reps)
    pycomm.set_options(fusion_threshold_bytes=default_threshold)
    # Where a fused step's time goes: the Python submission loop alone (allreduce_async calls,
    # no waiting), slowest rank, median of reps; the engine reduces while it runs.
    import time

    from mpi4py import MPI

    subs = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        hs = [pycomm.allreduce_async(g, op="avg", name=n) for g, n in zip(reversed(grads), reversed(names))]
        dt = time.perf_counter() - t0
        for h in hs:
            h.wait()
        subs.append(comm.allreduce(dt, op=MPI.MAX))
    results["submit only"] = dict(time_ms=sorted(subs)[len(subs) // 2] * 1e3, rounds_per_step=float("nan"))
    if comm.rank == 0:
        opts = pycomm.get_options()
        print(f"# {label}: {len(shapes)} tensors, {nparams:,} parameters ({nparams * 4 / 2**20:.2f} MiB), "
              f"{comm.size} ranks, threshold {opts['fusion_threshold_bytes'] >> 20} MiB, "
              f"cycle {opts['cycle_time_ms']} ms, median of {reps}")
        print(f"  {'mode':>14} {'time_ms':>10} {'rounds/step':>12}")
        for mode, r in results.items():
            print(f"  {mode:>14} {r['time_ms']:>10.2f} {r['rounds_per_step']:>12.1f}")
        speedup = results["per tensor"]["time_ms"] / results["fused"]["time_ms"]
        bound = results["fused"]["time_ms"] / results["one allreduce"]["time_ms"]
        print(f"# fused is {speedup:.2f}x faster than one allreduce per tensor, "
              f"and {bound:.2f}x the time of one allreduce of the same total bytes; submitting the "
              f"{len(shapes)} calls alone takes {results['submit only']['time_ms'] / results['fused']['time_ms']:.2f}x "
              f"of the fused step ({results['submit only']['time_ms'] * 1e3 / len(shapes):.1f} us a call)")
        print(f"# fused (one allreduce_async call per tensor, then wait on each) is "
              f"{results['blocking']['time_ms'] / results['fused']['time_ms']:.2f}x faster than one blocking "
              f"pycomm.allreduce per tensor")
        grouped = results["grouped"]["time_ms"]
        print(f"# grouped (one call) is {results['per tensor']['time_ms'] / grouped:.2f}x faster than one allreduce "
              f"per tensor, {results['fused']['time_ms'] / grouped:.2f}x faster than fused one call per tensor, and "
              f"{grouped / results['one allreduce']['time_ms']:.2f}x the time of one allreduce of the same bytes")
    return dict(label=label, tensors=len(shapes), parameters=nparams, results=results)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--models", default="resnet50,small",
                   help="comma list of resnet50, mlp (train_throughput.py's MLP), small (400 tensors of 1-4 KiB)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    pycomm.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    default_threshold = pycomm.get_options()["fusion_threshold_bytes"]
    models = {"resnet50": ("ResNet-50 gradients", resnet50_shapes), "mlp": ("MLP gradients", mlp_shapes),
              "small": ("400 tensors of 1-4 KiB", small_shapes)}
    out = []
    for m in args.models.split(","):
        if m not in models:
            p.error(f"unknown model {m!r}; choose resnet50, mlp or small")
        out.append(run_model(models[m][0], models[m][1](), comm, args.reps, default_threshold))
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ranks=comm.size, models=out), f, indent=1)
    pycomm.shutdown()


if __name__ == "__main__":
    main()
