"""Study: synchronous algorithms on the digits task at N ranks, beside single-process training.

    python bench/study_sync.py [--np 4] [--seeds 0 1 2] [--epochs 10] [--sync-period 8] [--out DIR]

Runs every configuration below for every seed inside one ``pycomm-run -np N``
job (so that start-up is paid once and wall times compare), plus the
single-process baselines in one ``-np 1`` job: one process training with the
same local optimizer on the same total samples (the whole training set per
epoch, batch = the per-rank batch). Writes ``study_sync.md`` (mean and
spread over seeds: final test accuracy, synchronizations, bytes sent per
rank, wall time), ``study_sync.json`` (every run) and ``study_sync.png``.
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
ADAM = ["--optimizer", "adam", "--lr", "0.002"]


def configs(tau: int, n: int) -> List[Dict]:
    t = ["--sync-period", str(tau)]
    scaled = ["--optimizer", "sgd", "--lr", f"{0.05 * n:g}", "--momentum", "0.9"]
    bmuf = ["--algorithm", "bmuf", *t, "--warmup-steps", "0"]
    return [
        {"label": "SSGD", "argv": ["--algorithm", "ssgd", *SGD], "base": "single SGD"},
        {"label": f"SSGD, lr x{n} (linear scaling)", "argv": ["--algorithm", "ssgd", *scaled], "base": "single SGD"},
        {"label": f"MA (tau={tau})", "argv": ["--algorithm", "model_averaging", *t, *SGD], "base": "single SGD"},
        {"label": f"BMUF-CBM (tau={tau})", "argv": [*bmuf, "--no-nesterov", *SGD], "base": "single SGD"},
        {"label": f"BMUF-NBM (tau={tau})", "argv": [*bmuf, "--nesterov", *SGD], "base": "single SGD"},
        {"label": "BMUF-Adam average", "argv": [*bmuf, "--moment-sync", "average", *ADAM], "base": "single Adam"},
        {"label": "BMUF-Adam keep", "argv": [*bmuf, "--moment-sync", "keep", *ADAM], "base": "single Adam"},
        {"label": "BMUF-Adam reset", "argv": [*bmuf, "--moment-sync", "reset", *ADAM], "base": "single Adam"},
        {"label": f"EASGD (tau={tau})", "argv": ["--algorithm", "easgd", *t, *SGD], "base": "single SGD"},
        {"label": f"ADMM ({tau} local steps)", "argv": ["--algorithm", "admm", "--local-steps", str(tau), *SGD],
         "base": "single SGD"},
    ]


SINGLE = [{"label": "single SGD", "argv": ["--algorithm", "ssgd", *SGD]},
          {"label": "single Adam", "argv": ["--algorithm", "ssgd", *ADAM]}]


def worker(opts) -> None:
    """Runs inside the MPI job: every configuration for every seed, one JSON line each (rank 0)."""
    sys.path.insert(0, ROOT)
    import pycomm

    pycomm.init()
    todo = SINGLE if opts.single else configs(opts.sync_period, pycomm.size())
    out = open(opts.results, "a") if pycomm.rank() == 0 else None
    # warm-up, not recorded: lazy initialization
    study_runner.train_quietly(["--epochs", "1", "--no-progress", "--no-bandwidth-table"])
    for cfg in todo:
        for seed in opts.seeds:
            argv = [*cfg["argv"], "--dataset", "digits", "--model", "mlp", "--epochs", str(opts.epochs),
                    "--batch-size", str(opts.batch_size), "--seed", str(seed), "--no-progress",
                    "--no-bandwidth-table"]
            summary = study_runner.train_quietly(argv)
            if out:
                rec = {"label": cfg["label"], "base": cfg.get("base"), "seed": seed, **summary}
                study_runner.append_record(out, rec)
                print(f"{cfg['label']:<24} seed {seed}: acc {summary['final_test_accuracy']:.2f}%  "
                      f"syncs {summary['syncs']}  {summary['wall_time_s']:.1f}s", flush=True)


stats = study_runner.stats


def report(records: List[dict], opts) -> str:
    from pycomm.tools.train.metrics import human_bytes

    labels = list(dict.fromkeys(r["label"] for r in records))
    by = {lab: [r for r in records if r["label"] == lab] for lab in labels}
    base_acc = {lab: stats([r["final_test_accuracy"] for r in by[lab]])[0] for lab in labels if lab.startswith("single")}
    lines = [f"Digits (1438 train / 359 test), MLP, {opts.np} ranks x batch {opts.batch_size}, {opts.epochs} epochs, "
             f"seeds {' '.join(map(str, opts.seeds))}; mean ± standard deviation over seeds. Single-process runs "
             f"use 1 rank, batch {opts.batch_size}, the same epochs (the same total samples). SGD: lr 0.05, "
             f"momentum 0.9; Adam: lr 0.002. BMUF: block lr 1, block momentum 1-1/N, no warm-up; MA, BMUF, "
             f"EASGD and ADMM synchronize every {opts.sync_period} local steps. Wall time: the training loop "
             f"only (OMP_NUM_THREADS=1, all runs of one table in one job), on a shared 2-core machine.",
             "",
             "| run | ranks | test accuracy (%) | vs single (points) | syncs | bytes sent per rank | wall time (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for lab in labels:
        rs = by[lab]
        acc, acc_sd = stats([r["final_test_accuracy"] for r in rs])
        syncs, _ = stats([r["syncs"] for r in rs])
        sent, _ = stats([r["bytes_sent"] for r in rs])
        wall, wall_sd = stats([r["wall_time_s"] for r in rs])
        base = rs[0].get("base")
        diff = f"{acc - base_acc[base]:+.2f}" if base in base_acc else "—"
        sync_col = "—" if rs[0]["world_size"] == 1 else f"{syncs:.0f}"
        sent_col = "—" if rs[0]["world_size"] == 1 else human_bytes(sent)
        lines.append(f"| {lab} | {rs[0]['world_size']} | {acc:.2f} ± {acc_sd:.2f} | {diff} | {sync_col} | "
                     f"{sent_col} | {wall:.2f} ± {wall_sd:.2f} |")
    return "\n".join(lines) + "\n"


def plot(records: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in records))
    accs = [stats([r["final_test_accuracy"] for r in records if r["label"] == lab]) for lab in labels]
    syncs = [0 if lab.startswith("single") else stats([r["syncs"] for r in records if r["label"] == lab])[0]
             for lab in labels]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    y = range(len(labels))
    a1.barh(list(y), [m for m, _ in accs], xerr=[s for _, s in accs], color="tab:blue")
    a1.set_yticks(list(y), labels)
    a1.invert_yaxis()
    lo = min(m - s for m, s in accs)
    a1.set_xlim(max(0.0, lo - 5), 100)
    a1.set_xlabel("final test accuracy (%), mean ± sd over seeds")
    a2.barh(list(y), syncs, color="tab:orange")
    a2.set_yticks(list(y), [""] * len(labels))
    a2.invert_yaxis()
    a2.set_xlabel("synchronizations")
    fig.suptitle("pycomm synchronous algorithms on digits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_runner.add_job_arguments(p)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--sync-period", type=int, default=8)
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return 0

    results = study_runner.fresh_results(opts.out, "study_sync")
    common = ["--worker", "--results", results, "--epochs", str(opts.epochs), "--batch-size", str(opts.batch_size),
              "--sync-period", str(opts.sync_period), "--seeds", *map(str, opts.seeds)]
    for np_, extra in ((1, ["--single"]), (opts.np, [])):
        rc = study_runner.launch("study_sync", np_, __file__, [*common, *extra])
        if rc != 0:
            return rc
    records = study_runner.read_records(results)
    study_runner.write_outputs(opts.out, "study_sync", report(records, opts), records, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
