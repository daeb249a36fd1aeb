"""Study: EC-DNN against model averaging and BMUF at equal communication, N ranks, several seeds.

    python bench/study_ec_dnn.py [--np 4] [--seeds 0 1 2] [--tau 8] [--epochs-large 2] [--epochs-digits 10]

Model averaging and BMUF synchronize every tau local steps with an allreduce
of the model (2 (N-1)/N S bytes sent per rank); EC-DNN exchanges the models
with an allgather ((N-1) S bytes), so at sync period N/2 tau it sends the
same bytes (the table shows bytes sent per rank). Two tasks:
synthetic-large with the MLP and digits with the CNN. SGD lr 0.05, momentum
0.9; BMUF without warm-up. Every run of a task for every seed inside one
``pycomm-run -np N`` job. Writes ``study_ec_dnn.md`` and ``study_ec_dnn.json``
beside the other studies.
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


def configs(tau: int, n: int) -> List[Dict]:
    tau_ec = max(1, tau * n // 2)
    return [
        {"label": f"MA (tau={tau})", "argv": ["--algorithm", "model_averaging", "--sync-period", str(tau)]},
        {"label": f"BMUF-NBM (tau={tau})", "argv": ["--algorithm", "bmuf", "--sync-period", str(tau),
                                                    "--warmup-steps", "0"]},
        {"label": f"EC-DNN (tau={tau_ec})", "argv": ["--algorithm", "ec_dnn", "--sync-period", str(tau_ec)]},
    ]


TASKS = {"synthetic-large": "mlp", "digits": "cnn"}


def worker(opts) -> None:
    sys.path.insert(0, ROOT)
    import pycomm

    pycomm.init()
    out = open(opts.results, "a") if pycomm.rank() == 0 else None
    epochs = {"synthetic-large": opts.epochs_large, "digits": opts.epochs_digits}
    for dataset in opts.tasks:
        for cfg in configs(opts.tau, pycomm.size()):
            for seed in opts.seeds:
                argv = [*cfg["argv"], *SGD, "--dataset", dataset, "--model", TASKS[dataset], "--epochs",
                        str(epochs[dataset]), "--batch-size", str(opts.batch_size), "--seed", str(seed),
                        "--no-progress", "--no-bandwidth-table"]
                summary = study_runner.train_quietly(argv)
                if out:
                    rec = {"task": dataset, "label": cfg["label"], "seed": seed, **summary}
                    study_runner.append_record(out, rec)
                    print(f"{dataset} {cfg['label']:<22} seed {seed}: acc {summary['final_test_accuracy']:.2f}%  "
                          f"sent {summary['bytes_sent']}  {summary['wall_time_s']:.1f}s", flush=True)


stats = study_runner.stats


def report(records: List[dict], opts, command: str) -> str:
    from pycomm.tools.train.metrics import human_bytes

    lines = [f"{opts.np} ranks x batch {opts.batch_size}, SGD (lr 0.05, momentum 0.9), seeds "
             f"{' '.join(map(str, opts.seeds))}; mean ± standard deviation over seeds. EC-DNN: lambda 0.5, "
             "T 1, distillation during the whole next round, the evaluated model is rank 0's local model of the "
             "last exchange. Wall time: the training loop only, on a shared 2-core machine.",
             "", f"Command: `{command}`", "",
             "| task | run | test accuracy (%) | syncs | bytes sent per rank | wall time (s) |",
             "|---|---|---:|---:|---:|---:|"]
    for task in dict.fromkeys(r["task"] for r in records):
        rs_t = [r for r in records if r["task"] == task]
        for lab in dict.fromkeys(r["label"] for r in rs_t):
            rs = [r for r in rs_t if r["label"] == lab]
            acc, sd = stats([r["final_test_accuracy"] for r in rs])
            syncs, _ = stats([r["syncs"] for r in rs])
            sent, _ = stats([r["bytes_sent"] for r in rs])
            wall, wsd = stats([r["wall_time_s"] for r in rs])
            lines.append(f"| {task} ({rs[0]['epochs']} epochs) | {lab} | {acc:.2f} ± {sd:.2f} | {syncs:.0f} | "
                         f"{human_bytes(sent)} | {wall:.2f} ± {wsd:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_runner.add_job_arguments(p)
    p.add_argument("--tau", type=int, default=8)
    p.add_argument("--epochs-large", type=int, default=2)
    p.add_argument("--epochs-digits", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return 0
    command = "python " + " ".join(["bench/study_ec_dnn.py", *sys.argv[1:]])
    results = study_runner.fresh_results(opts.out, "study_ec_dnn")
    rc = study_runner.launch("study_ec_dnn", opts.np, __file__,
                             ["--worker", "--results", results, "--tau", str(opts.tau),
                              "--epochs-large", str(opts.epochs_large), "--epochs-digits", str(opts.epochs_digits),
                              "--batch-size", str(opts.batch_size), "--tasks", *opts.tasks,
                              "--seeds", *map(str, opts.seeds)])
    if rc != 0:
        return rc
    records = study_runner.read_records(results)
    study_runner.write_outputs(opts.out, "study_ec_dnn", report(records, opts, command), records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
