"""Training throughput (samples/s) of data-parallel SGD, every way pycomm offers, in one run.

Run under MPI, e.g.:

    pycomm-run -np 2 python bench/train_throughput.py
    pycomm-run -np 2 python bench/train_throughput.py --models mlp --steps 50 --json out.json

For each model (an MLP and a small CNN, synthetic data) it times the same
training step with:

- ddp-gloo       torch DistributedDataParallel over gloo (the baseline)
- local          no communication (each rank trains alone): the ceiling
- pycomm-<c>     pycomm.DistributedOptimizer with compression c in none, fp16, bf16, onebit
- ddp-hook-<c>   torch DDP with pycomm's comm hook (pycomm.ddp_hooks) for c in fp16, onebit

samples/s counts every rank's samples (global batch per step / step time);
the step time is the median over steps of the slowest rank. The modes run
round-robin (one step of each per round), so load changes during the run
hit all of them alike; ratios are against ddp-gloo measured in the same run. wire MB/step is what one rank
sends per step for the gradients (pycomm rows; DDP-gloo's ring would send
what pycomm-none sends).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
from torch import nn

import pycomm
from pycomm import ddp_hooks

MODES = ["ddp-gloo", "local", "pycomm-none", "pycomm-fp16", "pycomm-bf16", "pycomm-onebit",
         "ddp-hook-fp16", "ddp-hook-onebit"]


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
    raise ValueError(f"unknown model {name!r}; choose mlp or cnn")


def init_gloo(comm):
    import torch.distributed as dist

    if dist.is_initialized():
        return
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    addr, port = comm.bcast((addr, port), root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank, world_size=comm.size)


def build(mode: str, model_name: str):
    """(model to call, optimizer to step, object reporting wire bytes or None)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(model_name)
    if mode == "local":
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), None
    if mode == "ddp-gloo":
        ddp = DDP(model)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), None
    if mode.startswith("ddp-hook-"):
        ddp = DDP(model)
        c = mode[len("ddp-hook-"):]
        state, hook = {"fp16": (ddp_hooks.FP16State(), ddp_hooks.fp16_hook),
                       "bf16": (ddp_hooks.BF16State(), ddp_hooks.bf16_hook),
                       "onebit": (ddp_hooks.OneBitState(), ddp_hooks.onebit_hook),
                       "none": (ddp_hooks.AllreduceState(), ddp_hooks.allreduce_hook)}[c]
        ddp.register_comm_hook(state, hook)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), state
    if mode.startswith("pycomm-"):
        opt = pycomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                          model.named_parameters(), compression=mode[len("pycomm-"):])
        return model, opt, opt
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


def time_modes(modes, model_name, comm, batch, steps, warmup):
    """Time one training step of every mode, round-robin: each round runs one step of each mode,
    so a change in machine load during the run hits every mode alike."""
    from mpi4py import MPI

    runs = {m: build(m, model_name) for m in modes}
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn((batch, 1, 28, 28), generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    times = {m: [] for m in modes}
    wire0 = {}
    for i in range(warmup + steps):
        for m in modes:
            model, opt, meter = runs[m]
            if i == warmup:
                wire0[m] = _wire(meter)
            comm.Barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= warmup:
                times[m].append(dt)
    rows = []
    for m in modes:
        model, _, meter = runs[m]
        t = statistics.median(times[m])
        wire = (_wire(meter) - wire0[m]) / steps if meter is not None else None
        rows.append(dict(model=model_name, mode=m, ranks=comm.size, batch_per_rank=batch,
                         params=sum(p.numel() for p in model.parameters()), step_ms=t * 1e3,
                         samples_per_s=batch * comm.size / t,
                         wire_mb_per_step=None if wire is None else wire / 1e6))
    return rows


def _wire(meter) -> int:
    if meter is None:
        return 0
    return int(meter.bytes_sent if hasattr(meter, "bytes_sent") else meter.wire_bytes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,cnn", help="comma list: mlp, cnn")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of: " + ", ".join(MODES))
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=30, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    pycomm.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if any(m.startswith("ddp") for m in modes):
        init_gloo(comm)
    rows = []
    if comm.rank == 0:
        print(f"# training throughput: {comm.size} ranks, batch {args.batch} per rank, SGD, median of the slowest "
              f"rank over {args.steps} steps; ratios against ddp-gloo")
        print(f"# {'model':>5} {'params':>9} {'mode':>16} {'step_ms':>9} {'samples/s':>10} {'vs ddp':>7} "
              f"{'wire MB/step':>12}")
    for model_name in filter(None, args.models.split(",")):
        model_rows = time_modes(modes, model_name, comm, args.batch, args.steps, args.warmup)
        base = next((r["samples_per_s"] for r in model_rows if r["mode"] == "ddp-gloo"), None)
        for row in model_rows:
            if base:
                row["vs_ddp_gloo"] = row["samples_per_s"] / base
            rows.append(row)
            if comm.rank == 0:
                ratio = f"{row['vs_ddp_gloo']:.2f}x" if base else "-"
                wire = "-" if row["wire_mb_per_step"] is None else f"{row['wire_mb_per_step']:.3f}"
                print(f"  {model_name:>5} {row['params']:>9} {row['mode']:>16} {row['step_ms']:>9.2f} "
                      f"{row['samples_per_s']:>10.0f} {ratio:>7} {wire:>12}", flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    pycomm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
