"""Allreduce of device tensors: pycomm none / fp16 / onebit against torch.distributed and a device copy.

    pycomm-run -np 2 python bench/gpu_allreduce.py                  # on a GPU machine (ranks may share a GPU)
    pycomm-run -np 2 python bench/gpu_allreduce.py --min-bytes 1M --max-bytes 256M --iters 10 --json out.json
    PYCOMM_FORCE_STAGING=1 pycomm-run -np 2 python bench/gpu_allreduce.py --device cpu --max-bytes 4M
                                                                    # dry run of the staged path on CPU tensors

For each size S (float32) it times, in the same run and on the same tensors:
  copy        one device-to-device copy of S bytes on every rank at once (GB/s = S / t): the memory
              bound every row below works against
  pycomm-<c>  pycomm.allreduce(x, compression=c), c in none, fp16, onebit; busbw = S/t * 2(N-1)/N
              (nccl-tests' definition, counting the uncompressed bytes: the compressed rows are
              "effective" bandwidth); the device path in use is printed in the header
  pycomm-staged  compression none with the peer path off (peer_path=False): the staged path beside
              the peer path in the same run, where the MPI is not CUDA-aware
  nccl        torch.distributed all_reduce over NCCL, where every rank of a node has a GPU of its own
  gloo        otherwise torch.distributed over gloo on the same device tensors (NCCL refuses two
              ranks on one GPU); the header says which baseline ran and why
Every timed call averages (op="avg"), so the tensor stays in range however often it is reduced
(a sum doubles it per call at 2 ranks, and fp16 passes 65504 within a row). Before the timing, each
compression's result of one call on the row's fresh input is checked: none and fp16 against the
float64 average from mpi4py (fp16 within its rounding bound), onebit against the numpy two-phase
reference (tests/parallel/compression_ref.py) up to --check-max-bytes; the `check` column says
ok or how far off. A row that cannot run prints its error instead of a figure, and any error or
failed check makes the exit status 1. Times are medians over --iters of the slowest rank, each
iteration ended by torch.cuda.synchronize() on CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

import pycomm
from pycomm.tools.benchmark import human_size, parse_size

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parallel"))

def slowest_median(fn, comm, iters: int, sync) -> float:
    from mpi4py import MPI

    times = []
    for i in range(iters + 1):
        sync()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i:
            times.append(dt)
    return statistics.median(times)


def check_once(x: torch.Tensor, compression: str, size: int, comm, check_max_bytes: int, sync) -> str:
    """One average of x's values with `compression` (a fresh name: zero residuals), against an
    independent reference on the host; "" if it holds, else what is off. x is not modified."""
    got = pycomm.allreduce(x.clone(), op="avg", compression=compression, name=f"check.{compression}.{size}")
    sync()
    got = got.cpu().numpy()
    mine = x.cpu().numpy()
    if compression == "onebit":
        if size > check_max_bytes:
            return ""
        from compression_ref import two_phase

        xs = comm.allgather(mine)
        n, N = mine.size, comm.size
        chunk = -(-n // (8 * N)) * 8
        ref, _, _, ambiguous = two_phase(xs, [np.zeros(n, np.float32)] * N, [np.zeros(chunk, np.float32)] * N)
        ok = ~ambiguous
        err = np.abs(got - ref)[ok]
        bound = 1e-6 * np.abs(ref[ok])
    else:
        ref = np.empty(mine.size, np.float64)
        comm.Allreduce(mine.astype(np.float64), ref)
        ref /= comm.size
        err = np.abs(got.astype(np.float64) - ref)
        # fp16: the inputs and the average each rounded to 11 bits, the sum in fp16 (pre-divided);
        # none: float32 sums of N terms.
        eps = 2.0 ** -11 if compression == "fp16" else 2.0 ** -24
        biggest = comm.allreduce(float(np.abs(mine).max()), op=_max())  # over every rank's input
        bound = 2 * (comm.size + 1) * eps * biggest + 1e-30
    bad = int(np.count_nonzero(err > bound))
    bad = comm.allreduce(bad)
    return "" if bad == 0 else f"{bad} element(s) off, up to {float(comm.allreduce(float(err.max()), op=_max())):.3g}"


def _max():
    from mpi4py import MPI

    return MPI.MAX


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-bytes", default="1M", type=parse_size)
    p.add_argument("--max-bytes", default="256M", type=parse_size)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--compressions", default="none,staged,fp16,onebit",
                   help="columns: compressions, and 'staged' (none, with the peer path off)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a dry run on CPU tensors (with PYCOMM_FORCE_STAGING or PYCOMM_FORCE_DEVICE_DIRECT "
                        "they take the device paths' code)")
    p.add_argument("--check-max-bytes", default="64M", type=parse_size,
                   help="largest size whose onebit result is checked against the numpy reference (it runs on "
                        "the host, in float32, over every rank's input)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch sees no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}); "
                "use --device cpu for a dry run")
    pycomm.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    N, rank = comm.size, comm.rank
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node.rank, node.size
    node.Free()
    if a.device == "cuda":
        gpus = torch.cuda.device_count()
        dev = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(dev)
        sync = torch.cuda.synchronize
        import torch.distributed as dist

        if dist.is_nccl_available() and local_size <= gpus:
            backend, why = "nccl", "one GPU per rank"
        else:
            backend = "gloo"
            why = (f"{local_size} ranks share {gpus} GPU(s), which NCCL refuses" if dist.is_nccl_available()
                   else "this torch has no NCCL")
        path = "CUDA-aware MPI" if pycomm._C.mpi_cuda_aware() else None  # said after the first allreduce
    else:
        dev, sync, backend, why = torch.device("cpu"), (lambda: None), "gloo", "CPU dry run"
        path = ("device-direct stand-in" if os.environ.get("PYCOMM_FORCE_DEVICE_DIRECT") == "1" else
                "peer stand-in" if os.environ.get("PYCOMM_FORCE_PEER") == "1" else
                "staged stand-in" if os.environ.get("PYCOMM_FORCE_STAGING") == "1" else "host path")
    from pycomm.tools.benchmark import init_torch_process_group

    init_torch_process_group(comm, backend)
    import torch.distributed as dist

    compressions = [c for c in a.compressions.split(",") if c]
    rows = []
    failed = False
    s = a.min_bytes
    while s <= a.max_bytes:
        n = s // 4
        g = torch.Generator().manual_seed(rank + s)
        x0 = torch.randn(n, generator=g).to(dev)
        x, y, z = x0.clone(), torch.empty_like(x0), x0.clone()
        row = {"size": s}
        row["copy_GBps"] = s / slowest_median(lambda: y.copy_(x), comm, a.iters, sync) / 1e9
        checks = []
        for c in compressions:
            staged = c == "staged"
            compression = "none" if staged else c
            try:
                if staged:
                    pycomm.set_options(peer_path=False)
                problem = check_once(x, compression, s, comm, a.check_max_bytes, sync)
                if problem:
                    checks.append(f"{c}: {problem}")
                t = slowest_median(lambda: pycomm.allreduce(x, op="avg", compression=compression,
                                                            name=f"bench.{c}.{s}"), comm, a.iters, sync)
                row[c] = s / t / 1e9 * 2 * (N - 1) / N if N > 1 else s / t / 1e9
            except Exception as e:  # a combination the device path refuses: report it, per row
                row[c] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
                failed = True
            finally:
                if staged:
                    pycomm.set_options(peer_path=True)
            comm.Barrier()
            x.copy_(x0)  # the next compression starts from the row's input
        row["check"] = "; ".join(checks) if checks else "ok"
        failed = failed or bool(checks)
        t = slowest_median(lambda: dist.all_reduce(z), comm, a.iters, sync)  # a float32 sum on its own copy
        row[backend] = s / t / 1e9 * 2 * (N - 1) / N if N > 1 else s / t / 1e9
        rows.append(row)
        s *= a.factor
    if path is None:
        path = {"peer": "peer reads inside the node (CUDA IPC), else staged"}.get(pycomm.stats()["device_path"],
                                                                                   pycomm.stats()["device_path"])
    if rank == 0:
        print(f"# allreduce of {a.device} float32 tensors, {N} ranks; pycomm path: {path}; baseline: {backend} "
              f"({why}); busbw GB/s (nccl-tests), median of {a.iters}, slowest rank")
        cols = ["copy_GBps"] + compressions + [backend]
        names = ["copy GB/s"] + [f"pycomm-{c}" for c in compressions] + [backend]
        print(f"{'size':>9} " + " ".join(f"{h:>12}" for h in names) + " " +
              " ".join(f"{c + '/' + backend:>12}" for c in compressions) + "  check")
        for r in rows:
            cells = [f"{r[c]:>12.2f}" if isinstance(r[c], float) else f"{'error':>12}" for c in cols]
            ratios = [f"{r[c] / r[backend]:>11.2f}x" if isinstance(r[c], float) and r[backend] else f"{'-':>12}"
                      for c in compressions]
            check = "ok" if r["check"] == "ok" else "FAILED"
            print(f"{human_size(r['size']):>9} " + " ".join(cells) + " " + " ".join(ratios) + f"  {check}")
        for r in rows:
            for c in compressions:
                if not isinstance(r[c], float):
                    print(f"# {human_size(r['size'])} pycomm-{c}: {r[c]}")
            if r["check"] != "ok":
                print(f"# {human_size(r['size'])} check: {r['check']}")
        print(f"# values checked: none and fp16 at every size, onebit up to {human_size(a.check_max_bytes)}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": a.device, "path": path, "baseline": backend, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    pycomm.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
