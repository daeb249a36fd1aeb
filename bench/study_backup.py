"""Study: synchronous SGD with backup workers (backup_sgd) against SSGD, with and without a straggler.

    python bench/study_backup.py [--np 4] [--seeds 0 1 2] [--epochs 10] [--backups 1] [--straggler-factors 3 30]
                                 [--target 90] [--eval-every 8]

Both run pycomm-train on digits (MLP, batch 16 per rank, SGD at pycomm-train's defaults) inside one
``pycomm-run -np N`` job, every seed, without a straggler and with ``--straggler N-1:FACTOR`` for each factor (the last
rank sleeps FACTOR - 1 times its forward and backward per step); within a seed the two algorithms run back to back,
so that the shared machine's load drifts over both alike. backup_sgd averages the first N - B gradients
of each step (docs/algorithms.md §4), SSGD all N. Rank 0 (never the straggler) measures test accuracy
every ``--eval-every`` of its steps against wall time. Reported per run: final test accuracy, time to
``--target`` accuracy, wall time, and for backup_sgd the share of steps that counted the straggler's
gradient (pycomm-train's summary ``counted_steps``). Writes ``study_backup.md`` and
``study_backup.json`` beside the other studies and prints the table.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import study_runner  # noqa: E402  (bench/, on sys.path as the script's folder)


def configs(backups: int) -> List[Dict]:
    return [
        {"label": "SSGD", "argv": ["--algorithm", "ssgd"]},
        {"label": f"backup_sgd (B={backups})", "argv": ["--algorithm", "backup_sgd", "--backup-workers",
                                                        str(backups)]},
    ]


def worker(opts) -> None:
    sys.path.insert(0, ROOT)
    import pycomm

    pycomm.init()
    n = pycomm.size()
    out = open(opts.results, "a") if pycomm.rank() == 0 else None
    # warm-up, not recorded
    study_runner.train_quietly(["--epochs", "1", "--no-progress", "--no-bandwidth-table", "--dataset", "digits"])
    for straggler in [None] + [f"{n - 1}:{f:g}" for f in opts.straggler_factors]:
        for seed in opts.seeds:
            for cfg in configs(opts.backups):
                argv = [*cfg["argv"], "--dataset", "digits", "--model", "mlp", "--epochs", str(opts.epochs),
                        "--batch-size", str(opts.batch_size), "--seed", str(seed), "--no-progress",
                        "--no-bandwidth-table", "--eval-every", str(opts.eval_every)]
                if straggler:
                    argv += ["--straggler", straggler]
                summary = study_runner.train_quietly(argv)
                if out:
                    rec = {"label": cfg["label"], "seed": seed, **summary, "straggler": straggler}
                    study_runner.append_record(out, rec)
                    print(f"{cfg['label']:<18} straggler {straggler or '-':>5} seed {seed}: acc "
                          f"{summary['final_test_accuracy']:.2f}%  {summary['wall_time_s']:.2f}s  counted "
                          f"{summary.get('counted_steps', '-')}", flush=True)


stats = study_runner.stats


time_to = study_runner.time_to


def report(records: List[dict], opts, command: str) -> str:
    slow = opts.np - 1
    lines = [f"digits (1438 train / 359 test), MLP, {opts.np} ranks x batch {opts.batch_size}, {opts.epochs} epochs, "
             f"SGD at pycomm-train's defaults, seeds {' '.join(map(str, opts.seeds))}; mean ± standard deviation over "
             f"seeds. Straggler Fx: rank {slow} sleeps F - 1 times its forward and backward per step (F times "
             f"slower). Time to {opts.target:g}%: wall time when rank 0's model first "
             f"measured >= {opts.target:g}% (every {opts.eval_every} steps of rank 0; runs that never reached it are "
             f"counted in the 'reached' column). Straggler counted: the share of steps whose average included rank "
             f"{slow}'s gradient. Shared 2-core machine, {opts.np} ranks oversubscribed.",
             "", f"Command: `{command}`", "",
             f"| run | straggler | test accuracy (%) | time to {opts.target:g}% (s) | reached | wall time (s) | "
             f"straggler counted |",
             "|---|---|---:|---:|---:|---:|---:|"]
    keys = list(dict.fromkeys((r["straggler"], r["label"]) for r in records))
    for strag, lab in keys:
        rs = [r for r in records if r["label"] == lab and r["straggler"] == strag]
        acc, acc_sd = stats([r["final_test_accuracy"] for r in rs])
        hit = [t for t in (time_to(r, opts.target) for r in rs) if t is not None]
        tcol = f"{stats(hit)[0]:.2f} ± {stats(hit)[1]:.2f}" if hit else "—"
        wall, wall_sd = stats([r["wall_time_s"] for r in rs])
        if "counted_steps" in rs[0]:
            share = stats([r["counted_steps"][slow] / max(r["steps"], 1) for r in rs])[0]
            counted = f"{100 * share:.0f}%"
        else:
            counted = "100% (every step)"
        factor = f"{float(strag.split(':')[1]):g}x" if strag else "none"
        lines.append(f"| {lab} | {factor} | {acc:.2f} ± {acc_sd:.2f} | "
                     f"{tcol} | {len(hit)}/{len(rs)} | {wall:.2f} ± {wall_sd:.2f} | {counted} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_runner.add_job_arguments(p)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--backups", type=int, default=1)
    p.add_argument("--straggler-factors", type=float, nargs="+", default=[3.0, 30.0])
    p.add_argument("--target", type=float, default=90.0)
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the table from the runs stored in OUT/study_backup.jsonl")
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return 0
    command = "python " + " ".join(["bench/study_backup.py", *[a for a in sys.argv[1:] if a != "--report-only"]])
    if opts.report_only:
        results = os.path.join(opts.out, "study_backup.jsonl")
    else:
        results = study_runner.fresh_results(opts.out, "study_backup")
        rc = study_runner.launch("study_backup", opts.np, __file__,
                                 ["--worker", "--results", results, "--epochs", str(opts.epochs), "--batch-size",
                                  str(opts.batch_size), "--backups", str(opts.backups), "--straggler-factors",
                                  *map(str, opts.straggler_factors), "--eval-every", str(opts.eval_every),
                                  "--seeds", *map(str, opts.seeds)])
        if rc != 0:
            return rc
    records = study_runner.read_records(results)
    study_runner.write_outputs(opts.out, "study_backup", report(records, opts, command), records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
