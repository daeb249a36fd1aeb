"""Allreduce across emulated hosts (pycomm-testbed), measured beside the alpha-beta model.

    python bench/testbed.py --testbed 2x2 --link-gbps 1 --size 64M [--iters 3] [--json out.json]

Outside a bed it brings one up (HOSTSxRANKS_PER_HOST, each host's egress
limited to --link-gbps), re-runs itself there and tears the bed down. Inside
(``PYCOMM_TESTBED`` set, e.g. under ``pycomm-testbed run``) it measures every
algorithm x compression pycomm offers and rank 0 prints one row each:

- time: the slowest rank's time of one allreduce, median of --iters rounds
  (each round runs every row once, so that load from elsewhere falls on all);
- algbw = S / t, busbw = algbw * 2(N-1)/N (nccl-tests; N = all ranks; for a
  compressed allreduce both on the uncompressed S);
- link/S: bytes each host sent through its shaped link per allreduce, over S
  (from the tbf qdisc counters, the host's egress; includes TCP/IP headers);
- model: f * w * S / B, with B the link rate, f the bytes per direction over
  the link per S (flat ring over M hosts x L ranks: 2(N-1)/N = 1.5 for 2x2;
  hierarchical: 2(M-1)/M = 1.0; MPI's own and auto: not known in advance, the
  lower bound for any allreduce between M hosts, 2(M-1)/M, is shown) and w the
  compression's wire fraction (fp16/bf16 1/2, onebit 1/32).
  Compressed allreduces run with algorithm auto: across hosts of equal size
  with several ranks each, that is the hierarchical form (float32 inside the
  host, the wire format only between hosts), so f is hierarchical's.
  The latency term (alpha) is negligible at 64 MiB; reduction and compression
  compute (gamma) are left out, and on a small, shared machine they are not
  negligible (meas/model shows it). "model@link" uses instead of B the rate a
  Sendrecv across the hosts reaches in the same run, which tells the link from
  the CPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

WIRE_FRACTION = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "onebit": 1 / 32}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def model_factor(algorithm: str, hosts: int, ranks_per_host: int) -> float:
    """Bytes each host sends over its link per byte of the message (alpha-beta model, beta term only)."""
    n = hosts * ranks_per_host
    if algorithm.startswith("hier"):
        return 2 * (hosts - 1) / hosts
    if algorithm == "ring":
        # A flat ring in rank order crosses each host boundary once per direction: every rank sends
        # 2(N-1)/N S, so each boundary link carries 2(N-1)/N S each way.
        return 2 * (n - 1) / n if hosts > 1 else 0.0
    # mpi (MPI's own), auto (pycomm's choice): the lower bound for any allreduce between the hosts.
    return 2 * (hosts - 1) / hosts


def host_sent() -> int:
    from pycomm.tools.testbed import parse_qdisc_bytes

    out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True, check=True)
    return parse_qdisc_bytes(out.stdout)


def sendrecv_time(comm, MPI, topo, nbytes: int) -> float:
    """Seconds for S to cross the link each way: every rank of host h exchanges S/L bytes with its
    counterpart on host h^1 (Sendrecv). 0 when there is no partner host."""
    import numpy as np

    if topo.num_nodes < 2 or topo.num_nodes % 2:
        return 0.0
    partner = (topo.node_rank ^ 1) * topo.local_size + topo.local_rank  # ranks are filled host by host
    buf = np.ones(nbytes // topo.local_size, dtype=np.uint8)
    out = np.empty_like(buf)
    comm.Barrier()
    t0 = time.perf_counter()
    comm.Sendrecv(buf, dest=partner, recvbuf=out, source=partner)
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def stage_breakdown(args, combos, x, comm, MPI, topo, rows) -> None:
    """--stages: where the time of each compressed row (and hierarchical/none) goes, from pycomm's
    timeline (every rank records its ranges; per range the median over --iters calls, then the mean
    over ranks), beside a plain copy of S bytes on every rank at once (torch copy_, the same machine
    and load) -- the memory bandwidth the in-host stages share."""
    import tempfile

    import torch

    import pycomm

    table = {(r["algorithm"], r["compression"]): r for r in rows}  # the table's rows, measured above
    rows = [c for c in combos if c[1] != "none" or c[0] == "hierarchical"]
    report = []
    tmp = tempfile.mkdtemp(prefix="pycomm_stages_") if comm.rank == 0 else None
    tmp = comm.bcast(tmp)
    for algorithm, compression, kw, name in rows:
        path = os.path.join(tmp, f"{algorithm}.{compression}.json")
        totals = []
        pycomm.start_timeline(path)
        for _ in range(args.iters):
            y = x.clone()
            comm.Barrier()
            t0 = time.perf_counter()
            pycomm.allreduce(y, algorithm=algorithm, name=name, **kw)
            totals.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        mine = pycomm.timeline_path()
        pycomm.stop_timeline()
        with open(mine) as fh:
            events = json.load(fh)["traceEvents"]
        stacks, durations, order = {}, {}, []
        for e in events:
            if e.get("ph") == "B":
                key = (len(stacks.setdefault(e["tid"], [])), e["name"])
                if key not in order:
                    order.append(key)  # in the order the ranges open
                stacks[e["tid"]].append(e)
            elif e.get("ph") == "E" and stacks.get(e["tid"]):
                b = stacks[e["tid"]].pop()
                durations.setdefault((len(stacks[e["tid"]]), b["name"]), []).append((e["ts"] - b["ts"]) / 1e3)
        med = {k: statistics.median(v) for k, v in durations.items() if len(v) >= args.iters}
        all_med = comm.allgather(med)
        keys = [k for k in order if all(k in m for m in all_med)]
        report.append((algorithm, compression, statistics.median(totals) * 1e3,
                       [(depth, nm, statistics.mean(m[(depth, nm)] for m in all_med)) for depth, nm in keys]))
    # A plain copy of S on every rank at once: what the memory system gives the ranks together.
    src = x.clone()
    dst = torch.empty_like(src)
    dst.copy_(src)
    copies = []
    for _ in range(max(args.iters, 3)):
        comm.Barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    t_copy = statistics.median(copies)
    if comm.rank == 0:
        nbytes = x.numel() * 4
        print(f"\n# stages (--stages): mean over the {topo.size} ranks of each range's median over {args.iters} "
              f"calls, ms; nested ranges indented")
        for algorithm, compression, total, ranges in report:
            print(f"{algorithm}/{compression}: {total:.1f} ms per call (slowest rank, median)")
            for depth, nm, ms in ranges:
                print(f"  {'  ' * depth}{nm:<28}{ms:>9.1f}")
        print(f"# copy of S = {nbytes >> 20} MiB on all {topo.size} ranks at once (torch copy_, median of "
              f"{len(copies)}): {t_copy * 1e3:.1f} ms = {nbytes / t_copy / 1e9:.2f} GB/s copied per rank, "
              f"{topo.size * 2 * nbytes / t_copy / 1e9:.2f} GB/s read+written by all ranks")
        if topo.num_nodes > 1 and topo.local_size > 1:
            # onebit's hierarchical form must at least, per rank: read its input (S) and write the slice's
            # node sum (S/L); compress it: read the sum and read+write the worker residual (3 S/L); the
            # server: zero its accumulator, M read+write passes adding the blocks, then read it and
            # read+write the server residual ((4 + 2M) S/(LM)); write the output (S). At the rate the
            # copy above reads+writes per rank (2 S / t_copy):
            L, M = topo.local_size, topo.num_nodes
            traffic = 2 * nbytes + 4 * nbytes / L + (4 + 2 * M) * nbytes / (L * M)
            floor = traffic / (2 * nbytes / t_copy)
            print(f"# onebit across nodes: at least {traffic / 2**20:.0f} MiB read+written per rank "
                  f"({traffic / nbytes:.1f} S) = {floor * 1e3:.1f} ms at the copy's rate "
                  f"({traffic / nbytes / 2:.1f} x the copy), before any link time")
            hier, onebit = table.get(("hierarchical", "none")), table.get(("auto", "onebit"))
            if hier and onebit:
                link = onebit["model_time_measured_link_s"]
                print(f"# so onebit takes at least {floor * 1e3:.1f} + {link * 1e3:.1f} ms (its bytes at the link rate "
                      f"measured above) and can be at most {hier['time_s'] / (floor + link):.2f}x faster than "
                      f"hierarchical/none ({hier['time_s'] * 1e3:.0f} ms in the table); measured "
                      f"{hier['time_s'] / onebit['time_s']:.2f}x")
        sys.stdout.flush()


def measure(args) -> int:
    import torch

    import pycomm
    from pycomm import collectives
    from mpi4py import MPI

    topo = pycomm.init()
    comm = MPI.COMM_WORLD
    local = pycomm.local_comm()
    n, hosts, rph = topo.size, topo.num_nodes, topo.local_size
    nbytes = args.size
    algorithms = [a for a in collectives.ALLREDUCE_ALGORITHMS if not args.algorithms or a in args.algorithms]
    compressions = list(getattr(collectives, "COMPRESSIONS", ("none",)))
    if args.compressions:
        compressions = [c for c in compressions if c in args.compressions]
    link_Bps = args.link_gbps * 1e9 / 8
    x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(comm.rank))
    refused = []  # (algorithm/compression, reason)
    combos = []
    for algorithm in algorithms:
        for compression in compressions:
            kw = {} if compression == "none" else {"compression": compression}
            name = f"bench.{algorithm}.{compression}"
            try:
                pycomm.allreduce(x.clone(), algorithm=algorithm, name=name, **kw)  # warm-up, connections
            except (ValueError, TypeError, pycomm.CommError) as e:  # refused alike on every rank
                refused.append((f"{algorithm}/{compression}", str(e)))
                continue
            combos.append((algorithm, compression, kw, name))
    sendrecv_time(comm, MPI, topo, nbytes)  # warm-up
    link_times = []
    times = {c[:2]: [] for c in combos}
    sent = {c[:2]: [] for c in combos}
    # Rounds of every combination once, so that load from elsewhere on the machine falls on all of
    # them alike and the ratios between rows stay fair.
    for _ in range(args.iters):
        link_times.append(sendrecv_time(comm, MPI, topo, nbytes))
        for algorithm, compression, kw, name in combos:
            y = x.clone()
            comm.Barrier()
            before = host_sent() if local.rank == 0 else 0
            comm.Barrier()
            t0 = time.perf_counter()
            pycomm.allreduce(y, algorithm=algorithm, name=name, **kw)
            dt = time.perf_counter() - t0
            comm.Barrier()
            got = host_sent() - before if local.rank == 0 else None
            times[(algorithm, compression)].append(comm.allreduce(dt, op=MPI.MAX))
            sent[(algorithm, compression)].append([v for v in comm.allgather(got) if v is not None])
    link_meas = nbytes / statistics.median(link_times) if link_times and link_times[0] else 0.0
    rows = []
    for algorithm, compression, _, _ in combos:
        t = statistics.median(times[(algorithm, compression)])
        algbw = nbytes / t
        f = model_factor(algorithm, hosts, rph)
        w = WIRE_FRACTION.get(compression, float("nan"))
        t_model = f * w * nbytes / link_Bps
        t_model_meas = f * w * nbytes / link_meas if link_meas else float("nan")
        rows.append({
            "algorithm": algorithm, "compression": compression, "bytes": nbytes, "ranks": n, "hosts": hosts,
            "time_s": t, "times_s": times[(algorithm, compression)], "algbw_gbps": algbw * 8 / 1e9,
            "busbw_gbps": algbw * 2 * (n - 1) / n * 8 / 1e9,
            "link_over_S": statistics.median(max(h) for h in sent[(algorithm, compression)]) / nbytes,
            "model_factor": f * w, "model_time_s": t_model, "model_time_measured_link_s": t_model_meas,
            "model_busbw_gbps": (nbytes / t_model * 2 * (n - 1) / n * 8 / 1e9) if t_model > 0 else float("inf"),
        })
    # Ratios against baselines of this run: an uncompressed row against the flat ring; a compressed
    # row against the uncompressed allreduce of the same schedule (hierarchical when the compressed
    # one runs the hierarchical form, else the flat ring).
    medians = {(r["algorithm"], r["compression"]): r["time_s"] for r in rows}
    compressed_form = "hierarchical" if hosts > 1 and rph > 1 else "ring"
    for r in rows:
        base = (compressed_form, "none") if r["compression"] != "none" else ("ring", "none")
        r["speedup_vs"] = f"{base[0]}/{base[1]}" if base in medians else None
        r["speedup"] = medians[base] / r["time_s"] if base in medians else float("nan")
    if comm.rank == 0:
        print(f"# allreduce of {nbytes} bytes (float32), {n} ranks = {hosts} hosts x {rph}, link "
              f"{args.link_gbps:g} Gbit/s per host egress, median of {args.iters}")
        print(f"# link measured now (Sendrecv, S each way): {link_meas * 8 / 1e9:.3f} Gbit/s per direction")
        hdr = (f"{'algorithm':<20}{'compression':<12}{'time ms':>9}{'algbw':>8}{'busbw':>8}{'link/S':>8}"
               f"{'model f':>9}{'model ms':>10}{'model busbw':>12}{'meas/model':>11}{'model@link ms':>14}"
               f"{'speedup':>9}")
        if refused:
            print(f"# refused up front, not measured: {', '.join(c for c, _ in refused)}")
            shown = [(c, r) for c, r in refused if c.endswith("/none")] or refused[:1]
            for combo, reason in shown:
                print(f"#   {combo}: {reason}")
        print(hdr)
        for r in rows:
            print(f"{r['algorithm']:<20}{r['compression']:<12}{r['time_s'] * 1e3:>9.0f}{r['algbw_gbps']:>8.3f}"
                  f"{r['busbw_gbps']:>8.3f}{r['link_over_S']:>8.3f}{r['model_factor']:>9.3f}"
                  f"{r['model_time_s'] * 1e3:>10.0f}{r['model_busbw_gbps']:>12.3f}"
                  f"{r['time_s'] / r['model_time_s'] if r['model_time_s'] else float('nan'):>11.2f}"
                  f"{r['model_time_measured_link_s'] * 1e3:>14.0f}{r['speedup']:>8.2f}x")
        print("# bandwidths in Gbit/s; link/S = bytes per host over its link / S (measured, with headers);")
        print("# model f = bytes per direction over the link / S from the alpha-beta model; model ms at the nominal")
        print("# rate, model@link ms at the rate the Sendrecv baseline measured in this run; speedup: time of")
        print(f"# ring/none (uncompressed rows) or {compressed_form}/none (compressed rows) / time")
        if args.markdown:
            print("\n| algorithm | compression | time ms | busbw Gbit/s | link bytes / S | model f | model@link ms "
                  "| speedup | against |")
            print("|---|---|---:|---:|---:|---:|---:|---:|---|")
            for r in rows:
                print(f"| {r['algorithm']} | {r['compression']} | {r['time_s'] * 1e3:.0f} | {r['busbw_gbps']:.2f} "
                      f"| {r['link_over_S']:.3f} | {r['model_factor']:.3f} | {r['model_time_measured_link_s'] * 1e3:.0f} "
                      f"| {r['speedup']:.2f}x | {r['speedup_vs']} |")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"link_gbps": args.link_gbps, "link_measured_gbps": link_meas * 8 / 1e9, "rows": rows},
                          fh, indent=1)
        sys.stdout.flush()
    if args.stages:
        stage_breakdown(args, combos, x, comm, MPI, topo, rows)
    pycomm.shutdown()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--testbed", default="2x2", help="HOSTSxRANKS_PER_HOST of the bed to bring up [2x2]")
    p.add_argument("--link-gbps", type=float, default=1.0, help="egress rate per host [1]")
    p.add_argument("--size", type=parse_size, default=64 << 20, help="message size, e.g. 64M [64M]")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--algorithms", nargs="*", default=None, help="subset of pycomm's allreduce algorithms")
    p.add_argument("--compressions", nargs="*", default=None, help="subset of pycomm's compressions")
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown (as in docs/multihost.md)")
    p.add_argument("--stages", action="store_true",
                   help="then time each stage of the compressed rows and hierarchical/none (pycomm's timeline) "
                        "beside a copy of S on every rank at once")
    args = p.parse_args(argv)
    from pycomm.tools.testbed import ENV_MARKER, relaunch

    if not os.environ.get(ENV_MARKER):
        # Re-run inside a fresh bed; --link-gbps stays on the command line for the model.
        os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
        argv_in = [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)]
        return relaunch(args.testbed, args.link_gbps, argv=argv_in)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
