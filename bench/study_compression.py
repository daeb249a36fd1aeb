"""Study: gradient compression (none, fp16, onebit, topk, threshold, powersgd) on synthetic-large, N ranks.

    python bench/study_compression.py [--np 4] [--seeds 0 1 2] [--epochs 3] [--out DIR]

Every configuration below runs for every seed inside one ``pycomm-run -np N``
job (start-up paid once; wall times compare) through pycomm-train:
``--algorithm ssgd --compression X``, SGD (lr 0.05, momentum 0.9), MLP.
Writes ``study_compression.md`` (mean ± sd over seeds of the final test
accuracy, bytes sent per rank and their ratio to uncompressed float32 in the
same run, wall time), ``study_compression.json`` (every run) and
``study_compression.png`` (accuracy against bytes sent).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import study_runner  # noqa: E402  (bench/, on sys.path as the script's folder)

SGD = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"]
CONFIGS: List[Dict] = [
    {"label": "none (float32)", "compression": "none"},
    {"label": "fp16", "compression": "fp16"},
    {"label": "onebit", "compression": "onebit"},
    {"label": "topk 1%", "compression": "topk:0.01"},
    {"label": "topk 10%", "compression": "topk:0.1"},
    {"label": "threshold 0.01", "compression": "threshold:0.01"},
    {"label": "threshold 0.05", "compression": "threshold:0.05"},
    {"label": "powersgd rank 1", "compression": "powersgd:1"},
    {"label": "powersgd rank 4", "compression": "powersgd:4"},
]


def worker(opts) -> None:
    """Runs inside the MPI job: every configuration for every seed, one JSON line each (rank 0)."""
    sys.path.insert(0, ROOT)
    import pycomm

    pycomm.init()
    out = open(opts.results, "a") if pycomm.rank() == 0 else None
    # warm-up, not recorded: lazy initialization
    study_runner.train_quietly(["--epochs", "1", "--no-progress", "--no-bandwidth-table"])
    for cfg in CONFIGS:
        for seed in opts.seeds:
            argv = ["--algorithm", "ssgd", "--compression", cfg["compression"], *SGD, "--dataset", "synthetic-large",
                    "--model", "mlp", "--epochs", str(opts.epochs), "--batch-size", str(opts.batch_size),
                    "--seed", str(seed), "--no-progress", "--no-bandwidth-table"]
            summary = study_runner.train_quietly(argv)
            if out:
                rec = {"label": cfg["label"], "compression": cfg["compression"], "seed": seed, **summary}
                study_runner.append_record(out, rec)
                print(f"{cfg['label']:<18} seed {seed}: acc {summary['final_test_accuracy']:.2f}%  "
                      f"sent {summary['bytes_sent']}  {summary['wall_time_s']:.1f}s", flush=True)


stats = study_runner.stats


def report(records: List[dict], opts, command: str) -> str:
    from pycomm.tools.train.metrics import human_bytes

    labels = list(dict.fromkeys(r["label"] for r in records))
    by = {lab: [r for r in records if r["label"] == lab] for lab in labels}
    base_sent = stats([r["bytes_sent"] for r in by["none (float32)"]])[0] if "none (float32)" in by else None
    lines = [f"synthetic-large (16384 train / 10000 test), MLP, {opts.np} ranks x batch {opts.batch_size}, "
             f"{opts.epochs} epochs, SSGD with SGD (lr 0.05, momentum 0.9), seeds {' '.join(map(str, opts.seeds))}; "
             "mean ± standard deviation over seeds. Bytes sent: per rank, pycomm's estimate of what the rank "
             "put on the wire (ring allreduce 2(N-1)/N S; onebit's two phases; topk/threshold (N-1) 8 K per "
             "allgather plus the K agreement; powersgd two ring allreduces). Wall time: the training loop only "
             "(OMP_NUM_THREADS=1, all runs in one job), on a shared 2-core machine.",
             "",
             f"Command: `{command}`",
             "",
             "| compression | test accuracy (%) | bytes sent per rank | vs none | wall time (s) |",
             "|---|---:|---:|---:|---:|"]
    for lab in labels:
        rs = by[lab]
        acc, acc_sd = stats([r["final_test_accuracy"] for r in rs])
        sent, _ = stats([r["bytes_sent"] for r in rs])
        wall, wall_sd = stats([r["wall_time_s"] for r in rs])
        ratio = f"{sent / base_sent:.3f}" if base_sent else "—"
        lines.append(f"| {lab} | {acc:.2f} ± {acc_sd:.2f} | {human_bytes(sent)} | {ratio} | {wall:.2f} ± {wall_sd:.2f} |")
    return "\n".join(lines) + "\n"


def plot(records: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in records))
    fig, ax = plt.subplots(figsize=(8, 5))
    for lab in labels:
        rs = [r for r in records if r["label"] == lab]
        acc, sd = stats([r["final_test_accuracy"] for r in rs])
        sent, _ = stats([r["bytes_sent"] for r in rs])
        ax.errorbar([max(sent, 1) / 2 ** 20], [acc], yerr=[sd], fmt="o", capsize=4, label=lab)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per rank (MiB, log scale)")
    ax.set_ylabel("final test accuracy (%), mean ± sd over seeds")
    ax.set_title("pycomm gradient compression on synthetic-large")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_runner.add_job_arguments(p)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return 0

    command = "python " + " ".join(["bench/study_compression.py", *sys.argv[1:]])
    results = study_runner.fresh_results(opts.out, "study_compression")
    rc = study_runner.launch("study_compression", opts.np, __file__,
                             ["--worker", "--results", results, "--epochs", str(opts.epochs),
                              "--batch-size", str(opts.batch_size), "--seeds", *map(str, opts.seeds)])
    if rc != 0:
        return rc
    records = study_runner.read_records(results)
    study_runner.write_outputs(opts.out, "study_compression", report(records, opts, command), records, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
