"""The cost model (pycomm.cost_model) projected to large jobs: the predicted time of one allreduce
of a gradient (100 MiB by default) from 8 to 1,024 nodes of 8 ranks, on links of 100 and 25 Gbit/s,
for every exact algorithm and for fp16 and 1-bit compression, with the crossover points "auto"
would use at each shape.

The constants inside a node are measured ones: the machine.json pycomm-tune stores
(`pycomm-run -np 2 pycomm-tune --model-only`; --machine names another file;
bench/results/machine-2ranks.json is the one the README's table used). Across nodes the link is
assumed: beta_x = 8 / (link bit rate) seconds per byte and alpha_x = --link-latency-us. It
measures nothing itself and needs no MPI job:

    PYCOMM_TUNE_DIR=/tmp/tune pycomm-run -np 2 pycomm-tune --model-only
    python bench/cost_projection.py --machine /tmp/tune/machine.json

The model's assumptions (printed with the table): every rank has a link of that rate across nodes
(one NIC per GPU, as DGX-class nodes have), so the L rings of `hierarchical` (one per local rank,
each on S/L bytes) run side by side; where a node's ranks share one NIC, that cross-node term is L
times larger. No congestion in the network, no overlap of computation and communication, and the
node's constants as measured at 2 ranks.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from pycomm import cost_model

# The compressions projected: bf16 costs what fp16 does in the model (cost_model.predict), so it is left out.
PROJECTED_COMPRESSIONS = ("fp16", "onebit")


def load_machine(path: str) -> cost_model.Machine:
    with open(path) as f:
        data = json.load(f)
    return cost_model.Machine(**data["constants"])


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def size_label(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def crossovers(machine: cost_model.Machine, ranks: int, nodes: int) -> str:
    """auto's table at this shape, as 'algo <= size, ..., algo above'."""
    table = cost_model.auto_table(machine, ranks, nodes)
    parts = [f"{algo} <= {size_label(size)}" for size, algo in table[:-1]]
    parts.append(f"{table[-1][1]} above" if parts else f"{table[-1][1]} at every size")
    return ", ".join(parts)


def project(machine: cost_model.Machine, nbytes: int, per_node: int, node_counts, gbits: float,
            latency_s: float) -> list:
    link = replace(machine, alpha_x=latency_s, beta_x=8.0 / (gbits * 1e9))
    rows = []
    for nodes in node_counts:
        ranks = nodes * per_node
        exact = cost_model.available(ranks, nodes)
        times = {a: cost_model.predict(a, nbytes, link, ranks, nodes) for a in exact + list(PROJECTED_COMPRESSIONS)}
        pick = min(exact, key=lambda a: times[a])
        rows.append(dict(nodes=nodes, ranks=ranks, times=times, auto=pick, crossovers=crossovers(link, ranks, nodes)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machine", help="machine.json from pycomm-tune (default: the stored one, PYCOMM_TUNE_DIR)")
    p.add_argument("--bytes", default="100M", help="the allreduce's size (default 100M)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--nodes", default="8,16,32,64,128,256,512,1024")
    p.add_argument("--links", default="100,25", help="link bit rates in Gbit/s")
    p.add_argument("--link-latency-us", type=float, default=5.0, help="alpha_x, one message across nodes")
    args = p.parse_args(argv)

    if args.machine:
        machine = load_machine(args.machine)
        source = args.machine
    else:
        from pycomm import auto_choice

        machine = auto_choice.load_model()
        source = auto_choice.model_path()
        if machine is None:
            print(f"bench/cost_projection.py: no stored constants at {source}; run "
                  "`pycomm-run -np 2 pycomm-tune --model-only` first or pass --machine", file=sys.stderr)
            return 2
    nbytes = parse_size(args.bytes)
    node_counts = [int(n) for n in args.nodes.split(",")]
    consts = ", ".join(f"{k} {v:.3g}" for k, v in machine.to_dict().items()
                       if k not in ("alpha_x", "beta_x") and v is not None)
    print(f"# predicted allreduce of {size_label(nbytes)}iB (float32), {args.ranks_per_node} ranks per node; "
          f"constants inside a node from {source}: {consts}")
    print(f"# across nodes: alpha_x {args.link_latency_us:g} us, beta_x = 8 / link bit rate, a link per rank "
          "(hierarchical's L rings side by side; with one shared NIC per node its cross-node term is L times "
          "larger); no congestion, no overlap with computation")
    for gbits in (float(g) for g in args.links.split(",")):
        rows = project(machine, nbytes, args.ranks_per_node, node_counts, gbits, args.link_latency_us * 1e-6)
        algos = list(rows[0]["times"])
        print(f"\n## {gbits:g} Gbit/s links: milliseconds")
        print("| nodes | ranks | " + " | ".join(algos) + " | fastest exact | auto's table (1 KiB to 1 GiB, powers of 2) |")
        print("|---" * (len(algos) + 4) + "|")
        for r in rows:
            cells = " | ".join(f"{r['times'][a] * 1e3:.1f}" for a in algos)
            print(f"| {r['nodes']} | {r['ranks']} | {cells} | {r['auto']} | {r['crossovers']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
