"""Training throughput (samples/s) of data-parallel SGD, every way pycomm offers, in one run.

Run under MPI, e.g.:

    pycomm-run -np 2 python bench/train_throughput.py
    pycomm-run -np 2 python bench/train_throughput.py --models mlp --steps 50 --json out.json
    pycomm-run -np 2 python bench/train_throughput.py --device cuda      # on a machine with GPUs

For each model (an MLP and a small CNN, synthetic data) it times the same
training step with:

- ddp-gloo       torch DistributedDataParallel over gloo (the baseline on CPU)
- ddp-nccl       DDP over NCCL (the baseline with --device cuda, where every rank of a node has a GPU
                 of its own; NCCL refuses two ranks on one GPU, and then the baseline is ddp-gloo on
                 the CUDA tensors, and the header line says so)
- local          no communication (each rank trains alone): the ceiling
- pycomm-<c>     pycomm.DistributedOptimizer with compression c in none, fp16, bf16, onebit
- ddp-hook-<c>   torch DDP with pycomm's comm hook (pycomm.ddp_hooks) for c in fp16, onebit

samples/s counts every rank's samples (global batch per step / step time);
the step time is the median over steps of the slowest rank. The modes run
round-robin (one step of each per round), so load changes during the run
hit all of them alike; ratios are against the DDP baseline measured in the same run. With --device cuda,
rank r of a node uses GPU r mod (GPUs of the node), and each step ends with torch.cuda.synchronize(). wire MB/step is what one rank
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

MODES = ["ddp-gloo", "ddp-nccl", "local", "pycomm-none", "pycomm-fp16", "pycomm-bf16", "pycomm-onebit",
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


def init_ddp(comm, backend: str):
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
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=comm.rank, world_size=comm.size)


def pick_device(name: str, comm, parser):
    """(device, DDP baseline backend, a note saying why that backend)."""
    if name == "cpu":
        return torch.device("cpu"), "gloo", "DDP's CPU backend"
    if not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device on this machine "
                     f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node.rank, node.size
    node.Free()
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % gpus)
    torch.cuda.set_device(device)
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return device, "gloo", "this torch has no NCCL"
    if local_size > gpus:
        return device, "gloo", f"{local_size} ranks share {gpus} GPU(s) on a node, which NCCL refuses"
    return device, "nccl", "one GPU per rank"


def build(mode: str, model_name: str, device: torch.device):
    """(model to call, optimizer to step, object reporting wire bytes or None)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(model_name).to(device)
    if mode == "local":
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), None
    if mode in ("ddp-gloo", "ddp-nccl"):
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


def time_modes(modes, model_name, comm, batch, steps, warmup, device):
    """Time one training step of every mode, round-robin: each round runs one step of each mode,
    so a change in machine load during the run hits every mode alike."""
    from mpi4py import MPI

    runs = {m: build(m, model_name, device) for m in modes}
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn((batch, 1, 28, 28), generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    loss_fn = nn.CrossEntropyLoss()
    times = {m: [] for m in modes}
    wire0 = {}
    for i in range(warmup + steps):
        for m in modes:
            model, opt, meter = runs[m]
            if i == warmup:
                wire0[m] = _wire(meter)
            sync()
            comm.Barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            sync()
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
    p.add_argument("--modes", default=None,
                   help="comma list of: " + ", ".join(MODES) + " (default: all but the DDP backend not in use)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models and data live")
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
    device, backend, note = pick_device(args.device, comm, p)
    baseline = f"ddp-{backend}"
    default = [m for m in MODES if m not in ("ddp-gloo", "ddp-nccl") or m == baseline]
    modes = [m for m in (args.modes.split(",") if args.modes else default) if m]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    other = {"ddp-gloo", "ddp-nccl"} - {baseline}
    if other & set(modes):
        p.error(f"--modes {sorted(other & set(modes))}: this run's DDP backend is {backend} ({note})")
    if any(m.startswith("ddp") for m in modes):
        init_ddp(comm, backend)
    rows = []
    if comm.rank == 0:
        print(f"# training throughput: {comm.size} ranks on {args.device}, batch {args.batch} per rank, SGD, median of "
              f"the slowest rank over {args.steps} steps; ratios against {baseline} ({note})")
        print(f"# {'model':>5} {'params':>9} {'mode':>16} {'step_ms':>9} {'samples/s':>10} {'vs ddp':>7} "
              f"{'wire MB/step':>12}")
    for model_name in filter(None, args.models.split(",")):
        model_rows = time_modes(modes, model_name, comm, args.batch, args.steps, args.warmup, device)
        base = next((r["samples_per_s"] for r in model_rows if r["mode"] == baseline), None)
        for row in model_rows:
            if base:
                row["vs_ddp"] = row["samples_per_s"] / base
            rows.append(row)
            if comm.rank == 0:
                ratio = f"{row['vs_ddp']:.2f}x" if base else "-"
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
