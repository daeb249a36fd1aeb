"""Allreduce bandwidth, reported like nccl-tests.

Run under MPI, e.g.:

    pycomm-run -np 4 python bench/allreduce.py
    pycomm-run -np 2 python bench/allreduce.py --min-bytes 1M --max-bytes 256M --json out.json --plot out.png

Every row times one implementation at one size in the same run: pycomm's
algorithms, MPI's own Allreduce through mpi4py, and torch.distributed's gloo
backend. time_us is the median over iterations of the slowest rank's time;
algbw = S / t; busbw = algbw * 2(N-1)/N (N = all ranks, for flat and
hierarchical alike); #wrong counts elements that differ from the exact
expected sum (the data are small integers, so every sum is exact).

--baselines c10d adds torch.distributed.all_reduce over backend "pycomm"
(pycomm.distributed); against the 'auto' row it is the cost of the c10d layer.

--compression fp16|bf16|onebit adds rows for pycomm's compressed allreduce
(op=avg, float32 input): busbw is the *effective* one, computed on the
uncompressed float32 size; wire_B is the bytes each rank actually sent
(other rows: the float32 ring's count) and #wrong counts elements off by
more than the compression's error (onebit: a 1-bit average is not exact, so
#wrong is not counted for it).

--model adds the memory-traffic bound of 'shm' and pycomm.cost_model's prediction beside the
measurements; --stages adds, per pycomm algorithm and size, the time of each stage the algorithm marks
(copy-in, reduction, copy-out, barrier, MPI; csrc/comm/stage_clock.h) with its bytes' rate, and the rest
of the call.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import numpy as np
import torch

import pycomm
from pycomm.tools.benchmark import bandwidth, median_time

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    unit = text[-1] if text and text[-1] in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


def human(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        scale = UNITS[unit[0]]
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def sizes(lo: int, hi: int, factor: int):
    s = lo
    while s <= hi:
        yield s
        s *= factor


class PycommImpl:
    def __init__(self, algorithm: str):
        self.name = algorithm
        self.algorithm = algorithm
        # tests/test_bench_exit.py: ranks name the call differently, so it fails with CommError.
        self.tag = f"bench.{pycomm.rank()}" if os.environ.get("PYCOMM_TEST_BENCH_DISAGREE") else None

    def __call__(self, x):
        pycomm.allreduce(x, algorithm=self.algorithm, name=self.tag)

    def unavailable(self, topo):
        """Why this algorithm cannot run on `topo` (the engine's own checks), or None."""
        if self.algorithm == "shm" and topo.num_nodes > 1:
            return f"shm reduces within one node and this job spans {topo.num_nodes}"
        if self.algorithm.startswith("hierarchical") and not topo.homogeneous:
            return "the nodes hold different numbers of ranks"
        return None


class CompressedImpl:
    """pycomm.allreduce(op="avg", compression=...) of the float32 tensor."""

    def __init__(self, compression: str):
        self.name = compression
        self.compression = compression
        self.wire_bytes = 0

    def __call__(self, x):
        h = pycomm.allreduce_async(x, op="avg", compression=self.compression,
                                   name=f"bench{x.numel()}", _blocking=True)
        h.wait()
        self.wire_bytes = h.wire_bytes


class MpiImpl:
    """MPI_Allreduce through mpi4py on a numpy view of the tensor (the MPI baseline)."""

    name = "mpi4py"

    def __init__(self, comm):
        from mpi4py import MPI

        self.comm, self.MPI = comm, MPI

    def __call__(self, x):
        if x.dtype in (torch.float16, torch.bfloat16):
            raise NotImplementedError
        arr = x.numpy()
        self.comm.Allreduce(self.MPI.IN_PLACE, arr, op=self.MPI.SUM)


class GlooImpl:
    name = "gloo"

    def __init__(self, comm):
        import torch.distributed as dist

        addr = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        else:
            port = None
        addr, port = comm.bcast((addr, port), root=0)
        self.group = None
        if dist.is_initialized():  # the c10d baseline made "pycomm" the default group
            self.group = dist.new_group(backend="gloo")
        else:
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank, world_size=comm.size)
        self.dist = dist

    def __call__(self, x):
        self.dist.all_reduce(x, group=self.group)


class C10dImpl:
    """torch.distributed.all_reduce over backend "pycomm" (pycomm.distributed): the c10d layer's cost
    on top of pycomm.allreduce (algorithm auto), measured against the 'auto' row."""

    name = "c10d"

    def __init__(self, comm):
        import torch.distributed as dist

        import pycomm.distributed  # noqa: F401  (registers "pycomm")

        self.group = None
        if dist.is_initialized():  # gloo came first as the default group
            self.group = dist.new_group(backend="pycomm")
        else:
            dist.init_process_group("pycomm")
        self.dist = dist

    def __call__(self, x):
        self.dist.all_reduce(x, group=self.group)


def c10d_overhead(comm, sizes_, iters):
    """Per call: dist.all_reduce over backend "pycomm" minus pycomm.allreduce (algorithm auto), the two
    interleaved call by call (so load changes hit both alike); medians of the slowest rank's times and
    of the per-pair differences.

    The difference is split in two, timed in the same rounds: `backend` calls the C++ backend object
    directly (ProcessGroupPycomm.allreduce([x], opts).wait(): pybind, the backend's checks, its Work
    and future) and `wrapper` is what dist.all_reduce adds on top (torch's Python function and its
    ProcessGroup dispatch). `fake_us` is dist.all_reduce on torch's fake backend, which communicates
    nothing: torch's own per-call cost, a floor no backend goes below."""
    import importlib
    import statistics

    from mpi4py import MPI
    import torch.distributed as dist

    import pycomm.distributed  # noqa: F401

    if not dist.is_initialized():
        dist.init_process_group("pycomm")
    group = None if dist.get_backend() == "pycomm" else dist.new_group(backend="pycomm")
    backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    try:
        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers backend "fake"

        fake = dist.new_group(backend="fake")
    except Exception as e:  # noqa: BLE001  (an internal torch module: report, do not fail the bench)
        if comm.rank == 0:
            print(f"# torch's fake backend is not available ({e}); fake_us not measured")
        fake = None

    def timed(fn):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    rows = []
    for nbytes in sizes_:
        x = torch.ones(nbytes // 4)
        a, b, c, f = [], [], [], []
        for i in range(iters + 5):
            ta = timed(lambda: pycomm.allreduce(x))
            tc = timed(lambda: backend.allreduce([x], opts).wait())
            tb = timed(lambda: dist.all_reduce(x, group=group))
            tf = timed(lambda: dist.all_reduce(x, group=fake)) if fake is not None else float("nan")
            if i >= 5:
                a.append(ta)
                b.append(tb)
                c.append(tc)
                f.append(tf)
        med = statistics.median
        rows.append(dict(size=nbytes, pycomm_us=med(a) * 1e6, c10d_us=med(b) * 1e6,
                         overhead_us=med(y - z for y, z in zip(b, a)) * 1e6,
                         backend_us=med(y - z for y, z in zip(c, a)) * 1e6,
                         wrapper_us=med(y - z for y, z in zip(b, c)) * 1e6,
                         fake_us=med(f) * 1e6,
                         pycomm_busbw=bandwidth(nbytes, med(a), comm.size)[1],
                         c10d_busbw=bandwidth(nbytes, med(b), comm.size)[1]))
    return rows


def copy_bandwidth(comm, nbytes, iters=5):
    """Per-rank memcpy bandwidth (bytes read + written per second) with every rank copying at once."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_time(lambda: dst.copy_(src), comm, iters, warmup=1)


def shm_model_seconds(nbytes, local_size, per_rank_copy_bw, chunked=False):
    """Memory-traffic bound of algorithm 'shm' on one node of L ranks, S bytes, per rank. One pass:
    copy-in of the (L-1)/L the peers reduce and of the reduced own slice (read S + write S),
    pairwise reduction of its S/L slice with L-1 peers, in place (read 2(L-1)/L S, write (L-1)/L S),
    copy-out of the peers' slices (read (L-1)/L S + write (L-1)/L S). Chunk by chunk (above
    pycomm._C.shm_pipeline_min_bytes) the window stays in cache and only the tensor crosses to
    memory: read S, write S."""
    L = local_size
    traffic = 2 * nbytes if chunked else 2 * nbytes + 5 * (L - 1) / L * nbytes
    return traffic / per_rank_copy_bw


STAGES = ("copy_in", "reduce", "copy_out", "barrier", "mpi")  # csrc/comm/stage_clock.h


def stage_breakdown(impl, comm, nbytes, dtype, iters):
    """--stages: one algorithm's calls timed with the engine's stage clock running. Per rank and call:
    the wall time of pycomm.allreduce, and the time and bytes of each stage the algorithm marked
    (stage_clock.h); 'other' is the rest of the call (queue, coordination round, Python). Means over
    ranks, with the copy bandwidth every rank gets while all copy at once, measured at this size."""
    esize = torch.empty(0, dtype=dtype).element_size()
    base = torch.full((nbytes // esize,), float(comm.rank + 1), dtype=dtype)
    x = base.clone()
    impl(x)
    pycomm._C.stage_clock_take()
    pycomm._C.stage_clock_run(True)
    wall = 0.0
    try:
        for _ in range(iters):
            x.copy_(base)
            comm.Barrier()
            t0 = time.perf_counter()
            impl(x)
            wall += time.perf_counter() - t0
    finally:
        pycomm._C.stage_clock_run(False)
    totals = pycomm._C.stage_clock_take()
    mine = np.array([wall] + [totals[s][0] for s in STAGES] + [totals[s][1] for s in STAGES], dtype=np.float64)
    mean = comm.allreduce(mine) / comm.size / iters
    copy_bw = copy_bandwidth(comm, nbytes)
    k = len(STAGES)
    call_s, stage_s, stage_b = mean[0], mean[1:1 + k], mean[1 + k:]
    rows = []
    for name, t, b in list(zip(STAGES, stage_s, stage_b)) + [("other", call_s - stage_s.sum(), 0.0)]:
        rate = b / t if t > 0 and b > 0 else None
        rows.append(dict(impl=impl.name, size=nbytes, stage=name, us=t * 1e6, share=t / call_s,
                         GBps=rate / 1e9 if rate else None,
                         of_copy=rate / copy_bw if rate and name != "mpi" else None))
    return dict(impl=impl.name, size=nbytes, call_us=call_s * 1e6, copy_GBps_per_rank=copy_bw / 1e9, stages=rows)


def print_stages(b):
    print(f"  {human(b['size']):>10} {b['impl']:>10} {'call':>9} {b['call_us']:>10.1f} {1:>6.0%}"
          f"   (copy bandwidth {b['copy_GBps_per_rank']:.2f} GB/s per rank)")
    for r in b["stages"]:
        if r["us"] <= 0.05 and r["stage"] != "other":
            continue
        gbps = f"{r['GBps']:.2f}" if r["GBps"] else "-"
        of_copy = f"{r['of_copy']:.2f}" if r["of_copy"] else "-"
        print(f"  {'':>10} {'':>10} {r['stage']:>9} {r['us']:>10.1f} {r['share']:>6.0%} {gbps:>8} {of_copy:>8}")


def time_impl(impl, comm, nbytes, dtype, iters, warmup):
    from mpi4py import MPI

    esize = torch.empty(0, dtype=dtype).element_size()
    count = nbytes // esize
    base = torch.full((count,), float(comm.rank + 1), dtype=dtype)
    x = base.clone()
    try:
        impl(x)
    except NotImplementedError:
        return None
    expected = float(comm.size * (comm.size + 1) // 2)
    if isinstance(impl, CompressedImpl):
        expected /= comm.size
        tol = 0 if impl.compression == "fp16" else 2.0 ** -7 * expected
        wrong = 0 if impl.compression == "onebit" else int(((x - expected).abs() > tol).sum())
    else:
        wrong = int((x != expected).sum())
    t = median_time(lambda: impl(x), comm, iters, warmup, before=lambda: x.copy_(base))
    algbw, busbw = bandwidth(nbytes, t, comm.size)
    wrong = comm.allreduce(wrong, op=MPI.SUM)
    wire = impl.wire_bytes if isinstance(impl, CompressedImpl) else pycomm._C.ring_wire_bytes(
        count, esize, comm.size, comm.rank)
    return dict(impl=impl.name, size=nbytes, count=count, dtype=str(dtype).replace("torch.", ""),
                time_us=t * 1e6, algbw=algbw, busbw=busbw, wrong=wrong, ranks=comm.size, wire_bytes=wire)


def timed_iterations(args, nbytes):
    """--iters, else by size (about 20 MB a row, 5 to 200 calls); --quick: at most 20."""
    iters = args.iters or max(5, min(200, int(2e8 // max(nbytes, 1)) // 10))
    return min(iters, 20) if args.quick else iters


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", default="8", type=parse_size)
    p.add_argument("--max-bytes", default="256M", type=parse_size)
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--algorithms", default="ring,shm,mpi",
                   help="pycomm algorithms to time (comma list of ring, mpi, shm, hierarchical, "
                        "hierarchical_master, auto)")
    p.add_argument("--baselines", default="mpi4py,gloo", help="baselines to time: mpi4py, gloo, c10d "
                   "(dist.all_reduce over backend 'pycomm') (comma list or '')")
    p.add_argument("--compression", default="", help="also time compressed allreduce: fp16, bf16, onebit "
                   "(comma list; float32 input, op=avg)")
    p.add_argument("--iters", type=int, default=0, help="timed iterations per row (default: by size)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a short table: 64 KiB, 1 MiB, 16 MiB")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--plot", help="write busbw against size to this PNG")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="group ranks into virtual nodes of this size (PYCOMM_RANKS_PER_NODE)")
    p.add_argument("--c10d-overhead", action="store_true",
                   help="only measure the c10d layer: dist.all_reduce over backend 'pycomm' against "
                        "pycomm.allreduce, interleaved call by call, at 4 KiB, 64 KiB, 1 MiB and 16 MiB")
    p.add_argument("--model", action="store_true",
                   help="also measure copy bandwidth with all ranks copying at once and print the memory-traffic "
                        "bound of 'shm' beside its measurement, and pycomm.cost_model's prediction beside every "
                        "pycomm algorithm's time (constants measured in the same run)")
    p.add_argument("--stages", action="store_true",
                   help="also time every pycomm algorithm with the engine's stage clock running and print where "
                        "its time goes: copy-in, reduction, copy-out, barrier and MPI, each with its bytes' rate "
                        "against the copy bandwidth, and the rest of the call")
    p.add_argument("--window-stores", default="auto", choices=("auto", "cached", "streaming"),
                   help="how every rank copies into the shm window (pycomm._C.set_window_stores): measured per "
                        "rank (auto), or always with ordinary or streaming stores")
    p.add_argument("--testbed", metavar="HOSTSxRANKS",
                   help="run inside emulated hosts joined by a shaped link, e.g. 2x2 (pycomm-testbed; needs root)")
    p.add_argument("--link-gbps", type=float, default=1.0, help="link rate of --testbed, Gbit/s")
    args = p.parse_args(argv)
    if args.testbed and not os.environ.get("PYCOMM_TESTBED"):
        from pycomm.tools import testbed

        return testbed.relaunch(args.testbed, args.link_gbps)

    if args.ranks_per_node:
        os.environ["PYCOMM_RANKS_PER_NODE"] = str(args.ranks_per_node)
    pycomm.init()
    pycomm._C.set_window_stores(args.window_stores)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if args.c10d_overhead:
        over = c10d_overhead(comm, [4 << 10, 64 << 10, 1 << 20, 16 << 20], args.iters or 200)
        if comm.rank == 0:
            print(f"# c10d layer cost: {comm.size} ranks, float32, algorithm auto, medians of the slowest rank, "
                  f"{args.iters or 200} interleaved pairs; overhead = median of per-pair differences")
            print(f"# {'size':>10} {'pycomm_us':>10} {'c10d_us':>10} {'overhead_us':>11} {'backend_us':>10} "
                  f"{'wrapper_us':>10} {'fake_us':>8} {'pycomm busbw':>12} {'c10d busbw':>10}")
            for r in over:
                print(f"  {human(r['size']):>10} {r['pycomm_us']:>10.1f} {r['c10d_us']:>10.1f} {r['overhead_us']:>11.1f} "
                      f"{r['backend_us']:>10.1f} {r['wrapper_us']:>10.1f} {r['fake_us']:>8.1f} "
                      f"{r['pycomm_busbw']:>12.3f} {r['c10d_busbw']:>10.3f}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(over, f, indent=1)
        import torch.distributed as dist

        dist.destroy_process_group()
        pycomm.shutdown()
        return 0
    dtype = DTYPES[args.dtype]
    impls = []
    for a in filter(None, args.algorithms.split(",")):
        impl = PycommImpl(a)
        # Algorithms this topology cannot run are skipped up front, by the same rule on every
        # rank; any CommError while timing is a failure (the program exits non-zero).
        reason = impl.unavailable(pycomm.topology())
        if reason is None:
            impls.append(impl)
        elif comm.rank == 0:
            print(f"# skipping {a}: {reason}")
    for c in filter(None, args.compression.split(",")):
        if c not in ("fp16", "bf16", "onebit"):
            p.error(f"unknown compression {c!r}; choose fp16, bf16 or onebit")
        if args.dtype != "float32":
            p.error("--compression reduces float32 tensors; leave --dtype float32")
        impls.append(CompressedImpl(c))
    for b in filter(None, args.baselines.split(",")):
        if b == "mpi4py":
            impls.append(MpiImpl(comm))
        elif b == "gloo":
            impls.append(GlooImpl(comm))
        elif b == "c10d":
            impls.append(C10dImpl(comm))
        else:
            p.error(f"unknown baseline {b!r}; choose mpi4py, gloo or c10d")
    size_list = [1 << 16, 1 << 20, 16 << 20] if args.quick else list(sizes(args.min_bytes, args.max_bytes, args.factor))

    rows = []
    if comm.rank == 0:
        topo = pycomm.topology()
        print(f"# pycomm allreduce benchmark: {comm.size} ranks, {topo.num_nodes} node(s), dtype {args.dtype}, "
              f"median of the slowest rank; busbw = algbw * 2(N-1)/N")
        print(f"# {'size':>10} {'count':>11} {'impl':>10} {'time_us':>11} {'algbw GB/s':>10} {'busbw GB/s':>10} "
              f"{'#wrong':>6} {'wire_B':>11}")
    for nbytes in size_list:
        iters = timed_iterations(args, nbytes)
        for impl in impls:
            row = time_impl(impl, comm, nbytes, dtype, iters, args.warmup)
            if row is None:
                continue
            rows.append(row)
            if comm.rank == 0:
                print(f"  {human(nbytes):>10} {row['count']:>11} {row['impl']:>10} {row['time_us']:>11.1f} "
                      f"{row['algbw']:>10.3f} {row['busbw']:>10.3f} {row['wrong']:>6} {row['wire_bytes']:>11}", flush=True)
    if comm.rank == 0:
        by_size = {}
        for r in rows:
            by_size.setdefault(r["size"], {})[r["impl"]] = r["busbw"]
        base = "mpi4py" if "mpi4py" in {i.name for i in impls} else None
        if base:
            print(f"# busbw ratio to {base} at the largest size:", ", ".join(
                f"{k} {v / by_size[max(by_size)][base]:.2f}x" for k, v in by_size[max(by_size)].items() if k != base))
    if args.model:
        topo = pycomm.topology()
        model_rows = []
        chunk = pycomm.get_options()["shm_chunk_bytes"]
        chunked_above = pycomm._C.shm_pipeline_min_bytes(topo.local_size, chunk) if chunk else None
        for nbytes in size_list:
            bw = copy_bandwidth(comm, nbytes)
            bound = shm_model_seconds(nbytes, topo.local_size, bw, chunked_above is not None and nbytes > chunked_above)
            shm = [r for r in rows if r["impl"] == "shm" and r["size"] == nbytes]
            model_rows.append(dict(size=nbytes, copy_GBps_per_rank=bw / 1e9, shm_bound_us=bound * 1e6,
                                   shm_us=shm[0]["time_us"] if shm else None))
        if comm.rank == 0:
            print(f"# memory-traffic model of 'shm' ({topo.local_size} ranks per node; per rank 4S + 3(L-1)/L S "
                  f"bytes in one pass, 2S chunk by chunk (above "
                  f"{human(chunked_above) if chunked_above else 'never: shm_chunk_bytes=0'}), at the copy "
                  f"bandwidth every rank gets while all copy at once)")
            print(f"# {'size':>10} {'copy GB/s/rank':>15} {'bound_us':>11} {'shm_us':>11} {'bound/shm':>10}")
            for m in model_rows:
                eff = f"{m['shm_bound_us'] / m['shm_us']:.2f}" if m["shm_us"] else "-"
                shm_us = f"{m['shm_us']:.1f}" if m["shm_us"] else "-"
                print(f"  {human(m['size']):>10} {m['copy_GBps_per_rank']:>15.2f} {m['shm_bound_us']:>11.1f} "
                      f"{shm_us:>11} {eff:>10}")
        # pycomm.cost_model: every pycomm algorithm's predicted time beside its measured one.
        from pycomm import cost_model
        from pycomm.tools import machine as cost_model_constants

        machine = cost_model_constants.measure(pycomm.world_comm(), pycomm.local_comm(), topo)
        shm_chunk, shm_chunked_above = cost_model.shm_pipeline(topo.local_size)
        predicted = []
        for r in rows:
            name = r["impl"]
            if name not in cost_model.ALGORITHMS + cost_model.COMPRESSED:
                continue
            t = cost_model.predict(name, r["size"], machine, comm.size, topo.num_nodes, shm_chunk, shm_chunked_above)
            predicted.append(dict(impl=name, size=r["size"], predicted_us=t * 1e6, measured_us=r["time_us"]))
        if comm.rank == 0:
            print("# pycomm.cost_model, constants measured in this run: " +
                  ", ".join(f"{k} {v:.3g}" for k, v in machine.to_dict().items()))
            print(f"# {'size':>10} {'impl':>20} {'predicted_us':>13} {'measured_us':>12} {'measured/pred':>13}")
            for m in predicted:
                ratio = m["measured_us"] / m["predicted_us"] if m["predicted_us"] > 0 else float("nan")
                print(f"  {human(m['size']):>10} {m['impl']:>20} {m['predicted_us']:>13.1f} {m['measured_us']:>12.1f} "
                      f"{ratio:>13.2f}")
        rows_out = dict(rows=rows, model=model_rows, cost_model=dict(constants=machine.to_dict(), rows=predicted))
    else:
        rows_out = rows
    if args.stages:
        if comm.rank == 0:
            print("# where the time goes (--stages), per call, means over ranks: the stages the algorithm marks "
                  "(csrc/comm/stage_clock.h) and 'other' (queue, coordination round, Python). GB/s = the stage's "
                  "bytes (memory read + written; mpi: sent + received) / its time; of_copy = that rate / the "
                  "copy bandwidth")
            print(f"# {'size':>10} {'impl':>10} {'stage':>9} {'us':>10} {'share':>6} {'GB/s':>8} {'of_copy':>8}")
        breakdown = []
        for nbytes in size_list:
            iters = timed_iterations(args, nbytes)
            for impl in impls:
                if isinstance(impl, PycommImpl):
                    breakdown.append(stage_breakdown(impl, comm, nbytes, dtype, iters))
                    if comm.rank == 0:
                        print_stages(breakdown[-1])
        if isinstance(rows_out, dict):
            rows_out["stages"] = breakdown
        else:
            rows_out = dict(rows=rows, stages=breakdown)
    if comm.rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows_out, f, indent=1)
        if args.plot:
            plot(rows, args.plot, comm.size)
    bad = sum(r["wrong"] for r in rows)
    pycomm.shutdown()
    return 1 if bad else 0


def plot(rows, path, nranks):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["impl"] for r in rows):
        pts = [(r["size"], r["busbw"]) for r in rows if r["impl"] == name]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"allreduce busbw, {nranks} ranks")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
