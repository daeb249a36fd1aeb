"""DDP training throughput over torch.distributed backends: "pycomm" against "gloo", in one run.

Run under MPI, e.g.:

    pycomm-run -np 2 python bench/ddp_backends.py
    pycomm-run -np 4 python bench/ddp_backends.py --models mlp --steps 20 --json out.json

The same torch DistributedDataParallel training step (the MLP and CNN of
bench/train_throughput.py, synthetic data, SGD with momentum) runs with its
process group on backend "pycomm" (the default group, pycomm.distributed) and
on a gloo group over the same ranks. A third mode, no-comm, runs the same step
on the bare model (no DDP, no communication, every rank computing at once as
in the others): gloo's step time over it is the most any backend could gain
over gloo (zero-cost communication). Modes run round-robin (one step of each
per round) so load changes hit all alike; samples/s counts every rank's
samples, the step time is the median of the slowest rank.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_throughput import make_model  # noqa: E402

import pycomm  # noqa: E402
import pycomm.distributed  # noqa: E402,F401  (backend "pycomm" and the rendezvous)

MODES = ["ddp-gloo", "ddp-pycomm", "no-comm"]


def time_modes(model_name, comm, groups, batch, steps, warmup, bucket_mb):
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel as DDP

    runs = {}
    for mode, group in groups.items():
        if mode == "no-comm":  # the same step without DDP: what no backend can make faster
            model = make_model(model_name)
        else:
            model = DDP(make_model(model_name), process_group=group, bucket_cap_mb=bucket_mb)
        runs[mode] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn((batch, 1, 28, 28), generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    times = {m: [] for m in groups}
    for i in range(warmup + steps):
        for m in groups:
            model, opt = runs[m]
            comm.Barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= warmup:
                times[m].append(dt)
    # Both runs started from the same weights and saw the same data: they must agree.
    pa = torch.cat([p.detach().reshape(-1) for p in runs["ddp-pycomm"][0].parameters()])
    pb = torch.cat([p.detach().reshape(-1) for p in runs["ddp-gloo"][0].parameters()])
    diff = float((pa - pb).abs().max())
    rows = []
    for m in groups:
        t = statistics.median(times[m])
        rows.append(dict(model=model_name, mode=m, ranks=comm.size, batch_per_rank=batch,
                         params=sum(p.numel() for p in runs[m][0].parameters()), step_ms=t * 1e3,
                         samples_per_s=batch * comm.size / t, max_param_diff=diff))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,cnn", help="comma list: mlp, cnn")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=30, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (torch's default 25)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    pycomm.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    dist.init_process_group("pycomm")
    groups = {"ddp-gloo": dist.new_group(backend="gloo"), "ddp-pycomm": None, "no-comm": None}
    rows = []
    if comm.rank == 0:
        print(f"# DDP over torch.distributed backends: {comm.size} ranks, batch {args.batch} per rank, "
              f"bucket {args.bucket_mb} MB, median of the slowest rank over {args.steps} steps")
        print(f"# {'model':>5} {'params':>9} {'mode':>11} {'step_ms':>9} {'samples/s':>10} {'vs gloo':>8} "
              f"{'max|dp|':>9}")
    for model_name in filter(None, args.models.split(",")):
        model_rows = time_modes(model_name, comm, groups, args.batch, args.steps, args.warmup, args.bucket_mb)
        base = next(r["samples_per_s"] for r in model_rows if r["mode"] == "ddp-gloo")
        for row in model_rows:
            row["vs_gloo"] = row["samples_per_s"] / base
            rows.append(row)
            if comm.rank == 0:
                dp = f"{row['max_param_diff']:>9.1e}" if row["mode"] == "ddp-pycomm" else f"{'':>9}"
                print(f"  {model_name:>5} {row['params']:>9} {row['mode']:>11} {row['step_ms']:>9.2f} "
                      f"{row['samples_per_s']:>10.0f} {row['vs_gloo']:>7.2f}x {dp}", flush=True)
        if comm.rank == 0:
            bound = next(r["vs_gloo"] for r in model_rows if r["mode"] == "no-comm")
            print(f"  {model_name:>5} bound: with zero-cost communication a step is at most {bound:.2f}x gloo's",
                  flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()
    pycomm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
