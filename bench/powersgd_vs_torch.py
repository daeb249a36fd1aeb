"""pycomm's PowerSGD DDP hook beside torch's own powerSGD_hook at the same rank, in the same run.

    python bench/powersgd_vs_torch.py [--np 4] [--rank 2] [--epochs 2] [--hidden 256] [--seed 0]

Under ``pycomm-run -np N`` every rank builds the same MLP (``--hidden`` units,
synthetic-large) and trains it with torch DDP over gloo four times, one after
the other, from the same initial weights and the same data order:

- ``gloo allreduce``: DDP's own float32 allreduce (no hook);
- ``torch powerSGD_hook``: torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook,
  matrix_approximation_rank=r, error feedback and warm start on,
  min_compression_rate=1 (pycomm's rule: compress whenever r(n+m) < nm),
  start_powerSGD_iter=2 (torch's smallest with error feedback);
- ``pycomm powersgd_hook``: pycomm.ddp_hooks.PowerSGDState(rank=r, warmup_steps=2);
- ``pycomm allreduce_hook``: pycomm's float32 allreduce (the engine's baseline).

Per run: final test accuracy, float32 elements handed to allreduce per step
(after the warm-up; torch's from its compression_stats(), pycomm's from the
same formula on its layout) and the median time of a training step (forward,
backward with the hook, SGD step). Time ratios are against gloo allreduce
in the same run. Prints a markdown table (rank 0).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=2, help="PowerSGD rank r (both implementations)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()

    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pycomm
    from pycomm import ddp_hooks
    from pycomm.tools.train.data import epoch_shard, load_dataset
    from pycomm.tools.train.models import MLP

    torch.set_num_threads(1)
    pycomm.init()
    from mpi4py import MPI

    from pycomm.tools.benchmark import init_torch_process_group

    comm = MPI.COMM_WORLD
    init_torch_process_group(comm, "gloo")
    n, me = comm.size, comm.rank
    data = load_dataset("synthetic-large")

    def run(kind: str):
        torch.manual_seed(opts.seed)
        model = DDP(MLP(data.input_shape, data.num_classes, hidden=opts.hidden), bucket_cap_mb=25)
        state = None
        if kind == "torch":
            state = tp.PowerSGDState(process_group=None, matrix_approximation_rank=opts.rank, start_powerSGD_iter=2,
                                     min_compression_rate=1, use_error_feedback=True, warm_start=True,
                                     random_seed=opts.seed)
            model.register_comm_hook(state, tp.powerSGD_hook)
        elif kind == "pycomm":
            state = ddp_hooks.PowerSGDState(rank=opts.rank, warmup_steps=2, seed=opts.seed)
            model.register_comm_hook(state, ddp_hooks.powersgd_hook)
        elif kind == "pycomm-allreduce":
            state = ddp_hooks.AllreduceState()
            model.register_comm_hook(state, ddp_hooks.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=0.9)
        times = []
        for epoch in range(opts.epochs):
            idx = torch.from_numpy(epoch_shard(len(data.x_train), n, me, opts.seed, epoch))
            for b in range(len(idx) // opts.batch_size):
                sl = idx[b * opts.batch_size:(b + 1) * opts.batch_size]
                comm.Barrier()  # every step starts together: the time is the step's, not a rank's lag
                t0 = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(data.x_train[sl]), data.y_train[sl]).backward()
                opt.step()
                times.append(time.perf_counter() - t0)
        with torch.no_grad():
            acc = float((model(data.x_test).argmax(1) == data.y_test).float().mean()) * 100
        steps = len(times)
        numel = sum(p.numel() for p in model.parameters())
        if kind == "torch":
            # elements after compression per compressed step (torch counts P's, Q's and the exact tensors)
            _, before, after = state.compression_stats()
            per_step = after / max(1, state.iter - state.start_powerSGD_iter)
            before_step = before / max(1, state.iter - state.start_powerSGD_iter)
            elems = f"{per_step:.0f} (of {before_step:.0f})"
        elif kind == "pycomm":
            c = state.compressor
            total = 0
            for name in c._layouts:
                pieces = c.pieces(name, ())
                total += sum(p.numel if not p.compressed else min(c.rank, p.rows, p.cols) * (p.rows + p.cols)
                             for p in pieces)
            elems = f"{total} (of {numel})"
        else:
            elems = f"{numel}"
        return acc, elems, statistics.median(times[5:]) if len(times) > 5 else statistics.median(times), steps

    rows = []
    for label, kind in (("gloo allreduce", "gloo"), ("torch powerSGD_hook", "torch"),
                        ("pycomm powersgd_hook", "pycomm"), ("pycomm allreduce_hook", "pycomm-allreduce")):
        acc, elems, t, steps = run(kind)
        rows.append((label, acc, elems, t, steps))
    if me == 0:
        base = rows[0][3]
        print(f"\nsynthetic-large, MLP (hidden {opts.hidden}), {n} ranks x batch {opts.batch_size}, {opts.epochs} epochs "
              f"({rows[0][4]} steps), SGD lr {opts.lr} momentum 0.9, PowerSGD rank {opts.rank}, seed {opts.seed}")
        print(f"Command: `python bench/powersgd_vs_torch.py {' '.join(sys.argv[1:])}` (under pycomm-run -np {n})\n")
        print("| run | test accuracy (%) | float32 elements allreduced per step | step time (ms, median) | vs gloo |")
        print("|---|---:|---:|---:|---:|")
        for label, acc, elems, t, _ in rows:
            print(f"| {label} | {acc:.2f} | {elems} | {t * 1e3:.2f} | {t / base:.2f} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
