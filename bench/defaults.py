"""pycomm-train's defaults measured: the parameter servers' step rule, and 1-bit Adam/LAMB against Adam.

    python bench/defaults.py async  [--np 4] [--seeds 0] [--epochs 5]
    python bench/defaults.py onebit [--np 4] [--seeds 0 1 2] [--epochs 5]

async: every parameter-server algorithm (pycomm.training.server_sgd()) on digits and on synthetic, under
three step rules: "default" (pycomm-train without --lr: sgd's lr / N pushing workers, momentum 0.9),
"lower momentum" (sgd's lr, --momentum 0: the explicit momentum taken out because asynchrony adds about
1 - 1/N of implicit momentum, Mitliagkas et al. 2016) and "unscaled" (--lr 0.05, momentum 0.9: every
worker's gradient with SSGD's lr, pycomm-train's default before the rule; asgd only), beside SSGD at its
defaults.

onebit: adam, onebit_adam and onebit_lamb at pycomm-train's defaults on digits, one run per seed.

Every run is pycomm-train's train() at its defaults except the options named, inside one
``pycomm-run -np N`` job (start-up paid once); rank 0 prints a markdown table of final test accuracy
(per seed and the median) and the median against the table's baseline row.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RULES = {"default": [], "lower momentum": ["--lr", "0.05", "--momentum", "0"], "unscaled": ["--lr", "0.05"]}


def configs(study: str):
    """(label, dataset, argv) per row; the first row of each dataset is its baseline."""
    from pycomm.training import server_sgd

    if study == "onebit":
        return [(opt, "digits", ["--optimizer", opt]) for opt in ("adam", "onebit_adam", "onebit_lamb")]
    rows = []
    for ds in ("digits", "synthetic"):
        rows.append(("ssgd (defaults)", ds, ["--algorithm", "ssgd"]))
        for algo in server_sgd():
            for rule, extra in RULES.items():
                if rule == "unscaled" and algo != "asgd":  # the old default, measured once (it fails alike)
                    continue
                rows.append((f"{algo}, {rule}", ds, ["--algorithm", algo, *extra]))
    return rows


def worker(opts) -> None:
    sys.path.insert(0, ROOT)
    import pycomm
    from pycomm.tools.train.cli import parse_args
    from pycomm.tools.train.loop import train

    pycomm.init()
    for label, ds, argv in configs(opts.study):
        for seed in opts.seeds:
            full = [*argv, "--dataset", ds, "--epochs", str(opts.epochs), "--seed", str(seed), "--no-progress",
                    "--no-bandwidth-table"]
            with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("always")
                s = train(parse_args(full))
            if pycomm.rank() == 0:
                print(json.dumps({"label": label, "dataset": ds, "seed": seed, "lr": s["lr"],
                                  "accuracy": round(s["final_test_accuracy"], 2),
                                  "final_train_loss": round(s["final_train_loss"], 4),
                                  "chance_warning": any("at chance level" in str(w.message) for w in caught)}),
                      flush=True)


def report(rows, seeds) -> str:
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        sub = [r for r in rows if r["dataset"] == ds]
        labels = list(dict.fromkeys(r["label"] for r in sub))
        med = {lb: statistics.median(r["accuracy"] for r in sub if r["label"] == lb) for lb in labels}
        base = labels[0]
        out += [f"**{ds}** (baseline: {base})", "",
                "| run | lr | " + " | ".join(f"seed {s}" for s in seeds) + " | median | vs baseline |",
                "|---|---|" + "---|" * len(seeds) + "---|---|"]
        for lb in labels:
            rs = {r["seed"]: r for r in sub if r["label"] == lb}
            cells = [f"{rs[s]['accuracy']:.2f}" + (" (warned)" if rs[s]["chance_warning"] else "") if s in rs
                     else "-" for s in seeds]
            lr = next(iter(rs.values()))["lr"]
            out.append(f"| {lb} | {lr:g} | " + " | ".join(cells) + f" | {med[lb]:.2f} | "
                       f"{med[lb] - med[base]:+.2f} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", choices=["async", "onebit"])
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.seeds is None:
        opts.seeds = [0, 1, 2] if opts.study == "onebit" else [0]
    if opts.worker:
        worker(opts)
        return 0
    cmd = [sys.executable, "-m", "pycomm.tools.launcher", "-np", str(opts.np), "--", sys.executable,
           os.path.abspath(__file__), opts.study, "--worker", "--epochs", str(opts.epochs), "--seeds",
           *map(str, opts.seeds)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith('{"label"')]
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
        print(f"defaults: the job failed with status {p.returncode} after {len(rows)} runs", file=sys.stderr)
    print(f"`python bench/defaults.py {opts.study} --np {opts.np} --epochs {opts.epochs} --seeds "
          f"{' '.join(map(str, opts.seeds))}`, final test accuracy (%):\n")
    print(report(rows, opts.seeds))
    return p.returncode


if __name__ == "__main__":
    sys.exit(main())
