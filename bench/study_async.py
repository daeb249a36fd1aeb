"""Study: the parameter-server algorithms at N workers, with and without a straggler, beside SSGD and
single-process SGD, on the synthetic-large task (10,000 test samples: one point of accuracy = 100 samples).

    python bench/study_async.py [--np 4] [--seeds 0 1 2] [--epochs 1] [--target 77] [--out DIR]

Every configuration runs for every seed inside one ``pycomm-run -np N`` job
(start-up paid once), without and with ``--straggler N-1:3`` (the last rank 3x
slower per step); single-process SGD runs in a ``-np 1`` job on the same total
samples. Rank 0 (never the straggler) records test accuracy every
``--eval-every`` of its steps against wall time. Reported per run: final test
accuracy, time to reach ``--target`` accuracy, mean and max staleness (server
updates between a worker's pull and its push). Writes ``study_async.md``,
``study_async.json`` and ``study_async.png`` (accuracy against wall time).

Step sizes: every asynchronous algorithm applies each worker's gradient with
lr 0.1 (the single-process lr); SSGD averages N gradients and uses lr 0.1 N
(linear scaling) and hybrid, whose groups of 2 average 2 gradients, lr 0.2, so every algorithm moves the
same distance per sample.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import study_runner  # noqa: E402  (bench/, on sys.path as the script's folder)
LR = 0.1


def configs(n: int) -> List[Dict]:
    sgd = ["--optimizer", "sgd", "--lr", f"{LR:g}", "--momentum", "0"]
    return [
        {"label": f"SSGD (lr x{n})", "argv": ["--algorithm", "ssgd", "--optimizer", "sgd", "--lr", f"{LR * n:g}",
                                            "--momentum", "0"]},
        {"label": "ASGD", "argv": ["--algorithm", "asgd", *sgd]},
        {"label": "SSP s=2", "argv": ["--algorithm", "ssp", "--staleness", "2", *sgd]},
        {"label": "SSP s=8", "argv": ["--algorithm", "ssp", "--staleness", "8", *sgd]},
        {"label": "DC-ASGD (lambda 0.04)", "argv": ["--algorithm", "dcasgd", "--dc-lambda", "0.04", *sgd]},
        {"label": "DC-ASGD-a (lambda0 2)", "argv": ["--algorithm", "dcasgd", "--adaptive", *sgd]},
        {"label": "AdaDelay (scale 0.05)", "argv": ["--algorithm", "adadelay", "--delay-scale", "0.05", *sgd]},
        {"label": f"hybrid ({n // 2} groups of 2, lr x2)",
         "argv": ["--algorithm", "hybrid", "--group-size", "2", "--optimizer", "sgd", "--lr", f"{LR * 2:g}",
                  "--momentum", "0"]},
    ]


SINGLE = [{"label": "single SGD", "argv": ["--algorithm", "ssgd", "--optimizer", "sgd", "--lr", f"{LR:g}",
                                           "--momentum", "0"]}]


def worker(opts) -> None:
    sys.path.insert(0, ROOT)
    import pycomm

    pycomm.init()
    n = pycomm.size()
    todo = SINGLE if opts.single else configs(n)
    stragglers = [None] if opts.single else [None, f"{n - 1}:3"]
    out = open(opts.results, "a") if pycomm.rank() == 0 else None
    # warm-up, not recorded
    study_runner.train_quietly(["--epochs", "1", "--no-progress", "--no-bandwidth-table", "--dataset", "digits"])
    for straggler in stragglers:
        for cfg in todo:
            for seed in opts.seeds:
                argv = [*cfg["argv"], "--dataset", "synthetic-large", "--model", "mlp", "--epochs", str(opts.epochs),
                        "--batch-size", str(opts.batch_size), "--seed", str(seed), "--no-progress",
                        "--no-bandwidth-table", "--eval-every", str(opts.eval_every)]
                if straggler:
                    argv += ["--straggler", straggler]
                summary = study_runner.train_quietly(argv)
                if out:
                    rec = {"label": cfg["label"], "seed": seed, **summary, "straggler": straggler}
                    study_runner.append_record(out, rec)
                    print(f"{cfg['label']:<24} straggler {straggler or '-':>4} seed {seed}: acc "
                          f"{summary['final_test_accuracy']:.2f}%  {summary['wall_time_s']:.1f}s  staleness "
                          f"{summary.get('staleness_mean', '-')}/{summary.get('staleness_max', '-')}", flush=True)


stats = study_runner.stats


time_to = study_runner.time_to


def report(records: List[dict], opts) -> str:
    keys = list(dict.fromkeys((r["label"], r["straggler"]) for r in records))
    single = [r["final_test_accuracy"] for r in records if r["label"] == "single SGD"]
    base = stats(single)[0] if single else None
    lines = [f"synthetic-large (16,384 train / 10,000 test), MLP, {opts.np} workers x batch {opts.batch_size}, "
             f"{opts.epochs} epoch(s), seeds {' '.join(map(str, opts.seeds))}; mean ± standard deviation over seeds. "
             f"Co-located servers (every rank a worker and a server). Straggler: rank {opts.np - 1} sleeps 2x its "
             f"compute time per step (3x slower). Time to {opts.target:g}%: wall time when rank 0's pulled model "
             f"first measured >= {opts.target:g}% (evaluated every {opts.eval_every} steps of rank 0; runs that "
             f"never reached it are counted in the 'reached' column). Staleness: server updates between a "
             f"worker's pull and its push (per tensor shard). Shared 2-core machine, 4 ranks oversubscribed.",
             "",
             f"| run | straggler | test accuracy (%) | vs single (points) | time to {opts.target:g}% (s) | reached | "
             f"mean staleness | max staleness | wall time (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for lab, strag in keys:
        rs = [r for r in records if r["label"] == lab and r["straggler"] == strag]
        acc, acc_sd = stats([r["final_test_accuracy"] for r in rs])
        tt = [time_to(r, opts.target) for r in rs]
        hit = [t for t in tt if t is not None]
        tcol = f"{stats(hit)[0]:.2f} ± {stats(hit)[1]:.2f}" if hit else "—"
        wall, wall_sd = stats([r["wall_time_s"] for r in rs])
        sm = f"{stats([r['staleness_mean'] for r in rs])[0]:.2f}" if "staleness_mean" in rs[0] else "—"
        sx = f"{max(r['staleness_max'] for r in rs)}" if "staleness_max" in rs[0] else "—"
        diff = f"{acc - base:+.2f}" if base is not None and lab != "single SGD" else "—"
        lines.append(f"| {lab} | {'3x' if strag else 'none'} | {acc:.2f} ± {acc_sd:.2f} | {diff} | {tcol} | "
                     f"{len(hit)}/{len(rs)} | {sm} | {sx} | {wall:.2f} ± {wall_sd:.2f} |")
    return "\n".join(lines) + "\n"


def plot(records: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for ax, strag in zip(axes, (False, True)):
        labels = list(dict.fromkeys(r["label"] for r in records if bool(r["straggler"]) == strag
                                    or r["label"] == "single SGD"))
        for i, lab in enumerate(labels):
            rs = [r for r in records if r["label"] == lab and (bool(r["straggler"]) == strag or lab == "single SGD")]
            for j, r in enumerate(rs):
                c = r.get("curve", [])
                ax.plot([p["wall_time_s"] for p in c], [p["test_accuracy"] for p in c], color=f"C{i}",
                        alpha=0.8, label=lab if j == 0 else None)
        ax.set_xlabel("wall time (s)")
        ax.set_title("with a 3x straggler" if strag else "no straggler")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%), rank 0's model")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle("pycomm asynchronous algorithms: accuracy against wall time (each line one seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_runner.add_job_arguments(p)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--target", type=float, default=77.0)
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the table and plot from the runs stored in OUT/study_async.jsonl")
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return 0
    if opts.report_only:
        return write_report(os.path.join(opts.out, "study_async.jsonl"), opts)
    results = study_runner.fresh_results(opts.out, "study_async")
    common = ["--worker", "--results", results, "--epochs", str(opts.epochs), "--batch-size", str(opts.batch_size),
              "--eval-every", str(opts.eval_every), "--seeds", *map(str, opts.seeds)]
    # single: batch 16 over all samples at 1 rank = N x the steps; evaluate every N x eval_every steps
    runs = ((1, ["--single", "--eval-every", str(opts.eval_every * opts.np)]), (opts.np, []))
    for np_, extra in runs:
        rc = study_runner.launch("study_async", np_, __file__, [*common, *extra])
        if rc != 0:
            return rc
    return write_report(results, opts)


def write_report(results: str, opts) -> int:
    records = study_runner.read_records(results)
    for r in records:  # runs stored before the straggler spec was kept apart from the summary's record
        if isinstance(r.get("straggler"), dict):
            r["straggler"] = f"{r['straggler']['rank']}:{r['straggler']['factor']:g}"
    study_runner.write_outputs(opts.out, "study_async", report(records, opts), records, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
