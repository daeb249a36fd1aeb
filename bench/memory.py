"""The engine's extra resident memory at steady state, against the fusion threshold.

    python bench/memory.py --np 2 [--thresholds 4M,16M,64M] [--algorithms auto,ring] [--steps 12]

For each (algorithm, fusion threshold) a fresh job of --np ranks (pycomm-run)
allreduces ResNet-50's 161 gradients (25.6 M float32, 102 MB) asynchronously
in backward order, --steps times, as DistributedOptimizer does. Per rank it
reads VmRSS after init with the gradients allocated and touched (before any
collective), after 3 steps (warm) and at the end, and the engine's own
accounting (pycomm.stats()): this rank's shared-window segment, the host
fusion buffer, the staging chunks, and how often the window was reallocated.
"extra" is end - before: what the engine added to the process; "growth" is
end - warm and should be ~0 (steady state). With `shm` (auto on one node) the
fused buffer is the rank's window segment and each rank also maps the
segments it reads, so RSS counts up to local_size segments of the window.
Printed: the largest value over ranks, in MiB.

No growth over many small collectives: bench/soak.py
(`pycomm-run -np 2 python bench/soak.py 50000`: 10^5 allreduces).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def worker(algorithm: str, steps: int) -> None:
    import torch

    import pycomm
    from fusion import resnet50_shapes

    pycomm.init()
    comm = pycomm.world_comm()
    grads = [torch.randn(s) for s in resnet50_shapes()]
    nbytes = sum(g.numel() for g in grads) * 4

    def step():
        hs = [pycomm.allreduce_async(g, op="avg", algorithm=algorithm, name=f"grad.{i}")
              for i, g in reversed(list(enumerate(grads)))]
        for h in hs:
            h.wait()

    comm.Barrier()
    before = rss_bytes()
    for i in range(steps):
        step()
        if i == 2:
            warm = rss_bytes()
    end = rss_bytes()
    st = pycomm.stats()
    row = dict(extra=end - before, growth=end - warm, shm_segment=st["shm_segment_bytes"],
               shm_allocations=st["shm_allocations"], fusion_buffer=st["fusion_buffer_bytes"],
               staging=st["staging_bytes"], fused=st["fused_tensors"])
    rows = comm.gather(row, root=0)
    if pycomm.rank() == 0:
        out = {k: max(r[k] for r in rows) for k in row}
        out.update(ranks=pycomm.size(), local_size=pycomm.local_size(), model_bytes=nbytes,
                   threshold=pycomm.get_options()["fusion_threshold_bytes"], algorithm=algorithm,
                   resolved=pycomm.resolve_algorithm(algorithm, min(nbytes, pycomm.get_options()[
                       "fusion_threshold_bytes"]) or nbytes))
        print("RESULT " + json.dumps(out), flush=True)
    pycomm.shutdown()


def launch(np: int, threshold: int, algorithm: str, steps: int) -> dict:
    from pycomm.tools.launcher import build_command, find_launcher, mpi_flavour

    env = dict(os.environ, PYCOMM_FUSION_THRESHOLD=str(threshold), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    launcher = find_launcher()
    cmd = build_command(np, [sys.executable, os.path.abspath(__file__), "--worker", algorithm, "--steps", str(steps)],
                        launcher=launcher, flavour=mpi_flavour(launcher), env=env)
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout[-4000:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--thresholds", default="4M,16M,64M")
    p.add_argument("--algorithms", default="auto,ring")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    if args.steps < 4:
        p.error("--steps must be at least 4 (3 warm-up steps, then steady state)")
    results = []
    print(f"{args.np} ranks, ResNet-50 gradients (102 MB float32), {args.steps} steps; MiB, largest over ranks")
    print("| algorithm (runs as) | fusion threshold | extra RSS | growth after warm-up | shm segment | "
          "shm reallocations | fusion buffer | staging | extra / threshold |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for algorithm in args.algorithms.split(","):
        for t in (parse_size(x) for x in args.thresholds.split(",")):
            r = launch(args.np, t, algorithm, args.steps)
            results.append(r)
            print(f"| {algorithm} ({r['resolved']}) | {t / MiB:.0f} | {r['extra'] / MiB:.1f} | "
                  f"{r['growth'] / MiB:.1f} | {r['shm_segment'] / MiB:.1f} | {r['shm_allocations']} | "
                  f"{r['fusion_buffer'] / MiB:.1f} | {r['staging'] / MiB:.1f} | {r['extra'] / t:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
