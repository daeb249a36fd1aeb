"""Fused LARS / LAMB update kernels against the torch-ops update of the same optimizer.

For each optimizer and tensor size: the median time of one optimizer step on
one float32 tensor with the fused kernel (pycomm._C.lars_update_ /
lamb_update_, ``fused=True``) and with torch ops (``fused=False``, the same
class), measured in the same run, same thread count, interleaved repeats.
Also GB/s of the fused kernel against its memory traffic per element
(LARS: 2 reads for the norms + 3 reads and 2 writes = 28 B; LAMB: 4 reads
and 2 writes + 3 reads and 1 write = 40 B).

Examples:
  python bench/optim_kernels.py                         # 64K .. 16M elements, 1 thread
  python bench/optim_kernels.py --sizes 1M,4M --threads 1,2 --repeats 20 --json out.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if glob.glob(os.path.join(ROOT, "pycomm", "_C*.so")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pycomm  # noqa: E402
from pycomm.optim import LAMB, LARS  # noqa: E402

TRAFFIC = {"lars": 28, "lamb": 40}


def parse_count(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)


def make(name: str, n: int, fused: bool):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, 1, generator=g))  # 2-D: not excluded
    p.grad = torch.randn(n, 1, generator=g) * 0.01
    opt = (LARS([p], lr=0.1, weight_decay=1e-4, fused=fused) if name == "lars"
           else LAMB([p], lr=1e-3, weight_decay=0.01, fused=fused))
    opt.step()  # allocate state
    return opt


def bench(name: str, n: int, repeats: int):
    opts = {f: make(name, n, f) for f in (False, True)}
    times = {False: [], True: []}
    for _ in range(repeats):
        for f in (False, True):  # interleaved, so both see the same machine load
            t0 = time.perf_counter()
            opts[f].step()
            times[f].append(time.perf_counter() - t0)
    return statistics.median(times[False]), statistics.median(times[True])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64K,1M,16M", help="elements per tensor, comma-separated (default 64K,1M,16M)")
    ap.add_argument("--threads", default="1", help="torch/OpenMP thread counts, comma-separated (default 1)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)        # the torch-ops path
        pycomm.kernels.set_cpu_threads(threads)  # the fused kernel
        for name in ("lars", "lamb"):
            for n in [parse_count(s) for s in args.sizes.split(",")]:
                t_ops, t_fused = bench(name, n, args.repeats)
                rows.append({"optimizer": name, "elements": n, "threads": threads, "torch_ops_ms": t_ops * 1e3,
                             "fused_ms": t_fused * 1e3, "speedup": t_ops / t_fused,
                             "fused_GBps": TRAFFIC[name] * n / t_fused / 1e9})
    print(f"| optimizer | elements | threads | torch ops ms | fused ms | speedup | fused GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['optimizer'].upper()} | {r['elements']:,} | {r['threads']} | {r['torch_ops_ms']:.3f} | "
              f"{r['fused_ms']:.3f} | {r['speedup']:.2f}x | {r['fused_GBps']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
