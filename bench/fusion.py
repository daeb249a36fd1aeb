"""Tensor fusion: allreduce of ResNet-50's 161 gradient tensors, fused against one call per tensor.

    pycomm-run -np 2 python bench/fusion.py [--reps 5] [--json out.json]

Both modes submit every gradient asynchronously in backward order (last
layer first) and then wait for all, as DistributedOptimizer does. "fused"
uses the engine's tensor fusion (PYCOMM_FUSION_THRESHOLD, PYCOMM_CYCLE_TIME_MS);
"per tensor" sets the threshold to 0 so each tensor is its own allreduce.
Times are medians over repetitions of the slowest rank.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import pycomm


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


def run_once(grads, comm):
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    handles = [pycomm.allreduce_async(g, op="avg", name=f"grad.{i}") for i, g in reversed(list(enumerate(grads)))]
    for h in handles:
        h.wait()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    pycomm.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    shapes = resnet50_shapes()
    grads = [torch.randn(s) for s in shapes]
    nparams = sum(g.numel() for g in grads)
    default_threshold = pycomm.get_options()["fusion_threshold_bytes"]
    results = {}
    for mode, threshold in (("fused", default_threshold), ("per tensor", 0)):
        pycomm.set_options(fusion_threshold_bytes=threshold)
        run_once(grads, comm)  # warm-up (window and buffer allocation)
        before = pycomm.stats()
        times = [run_once(grads, comm) for _ in range(args.reps)]
        after = pycomm.stats()
        results[mode] = dict(time_ms=statistics.median(times) * 1e3,
                             rounds_per_step=(after["rounds"] - before["rounds"]) / args.reps)
    pycomm.set_options(fusion_threshold_bytes=default_threshold)
    if comm.rank == 0:
        opts = pycomm.get_options()
        print(f"# ResNet-50 gradients: {len(shapes)} tensors, {nparams:,} parameters ({nparams * 4 / 2**20:.1f} MiB), "
              f"{comm.size} ranks, threshold {opts['fusion_threshold_bytes'] >> 20} MiB, "
              f"cycle {opts['cycle_time_ms']} ms")
        print(f"  {'mode':>12} {'time_ms':>10} {'rounds/step':>12}")
        for mode, r in results.items():
            print(f"  {mode:>12} {r['time_ms']:>10.1f} {r['rounds_per_step']:>12.1f}")
        ratio = results["per tensor"]["time_ms"] / results["fused"]["time_ms"]
        print(f"# fused is {ratio:.2f}x faster than one allreduce per tensor")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(results=results, ratio=ratio, ranks=comm.size, tensors=len(shapes),
                               parameters=nparams), f, indent=1)
    pycomm.shutdown()


if __name__ == "__main__":
    main()
