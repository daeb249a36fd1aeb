"""Every training mode of pycomm-train at its defaults: algorithm x optimizer x precision x compression.

    python bench/matrix.py [--np 4] [--max-runs K] [--max-minutes M] [--retry-failed] [--table-only | --summary]

Cells: every algorithm of pycomm.training x {sgd, adam, lars, lamb, onebit_adam, onebit_lamb} x
{fp32, fp16, bf16} x {none, fp16, onebit compression}. Each cell is first put to pycomm-train's own
option checks (pycomm.tools.train.cli.parse_args, no MPI; asked afresh on every invocation, never stored):
a combination it refuses shows its refusal message. Every allowed cell is one run of
pycomm-train's train() with

    --algorithm A --optimizer O [--precision P] [--compression C] --dataset digits

and every other option at its default (mlp, batch 16 per rank, 5 epochs, seed 0), in turn inside one
``pycomm-run -np 4`` job (start-up paid once; each run seeds and builds everything afresh). Results go to
bench/results/matrix.json after every run, so an interrupted or partial run continues where it
stopped: a rerun runs only the allowed cells that have no result yet (--retry-failed also those that
failed). --max-runs / --max-minutes bound one invocation (run the matrix in chunks).

Prints one table: rows algorithm/optimizer, columns precision/compression; a cell is the final test
accuracy in percent, "refused [k]" (message k below the table), "FAILED" (exit status and the last
error line in the results file), or "not run" (no result yet). Writes the same table to
docs/matrix.md (--markdown). Accuracies below --threshold (85) are marked with "!", runs that printed
pycomm-train's chance-level warning with "w".
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

OPTIMIZERS = ("sgd", "adam", "lars", "lamb", "onebit_adam", "onebit_lamb")
PRECISIONS = ("fp32", "fp16", "bf16")
COMPRESSIONS = ("none", "fp16", "onebit")
DEFAULT_RESULTS = os.path.join(HERE, "results", "matrix.json")
DEFAULT_MARKDOWN = os.path.join(ROOT, "docs", "matrix.md")


def algorithms() -> List[str]:
    from pycomm.training import names

    return names()


def cells() -> List[Tuple[str, str, str, str]]:
    return list(itertools.product(algorithms(), OPTIMIZERS, PRECISIONS, COMPRESSIONS))


def key(cell) -> str:
    return "/".join(cell)


def train_argv(cell) -> List[str]:
    algo, opt, prec, comp = cell
    argv = ["--algorithm", algo, "--optimizer", opt, "--dataset", "digits"]
    if prec != "fp32":
        argv += ["--precision", prec]
    if comp != "none":  # --compression none is the default; an algorithm without the option refuses it
        argv += ["--compression", comp]
    return argv


def refusal(cell) -> Optional[str]:
    """pycomm-train's refusal message for this combination, or None if its option checks accept it."""
    from pycomm.tools.train.cli import parse_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(train_argv(cell))
    except SystemExit as e:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        msg = lines[-1].split("error:", 1)[1].strip() if lines else f"exit status {e.code}"
        return msg
    return None


def load(path: str) -> Dict[str, dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)["cells"]


def save(path: str, results: Dict[str, dict], meta: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "cells": results}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def worker(keys: List[str]) -> None:
    """Inside one pycomm-run job: train() every cell in turn; rank 0 prints START and a JSON line per cell."""
    import warnings

    import pycomm
    from pycomm.tools.train.cli import parse_args
    from pycomm.tools.train.loop import train

    pycomm.init()
    for k in keys:
        if pycomm.rank() == 0:
            print(f"START {k}", flush=True)
        argv = [*train_argv(tuple(k.split("/"))), "--no-progress", "--no-bandwidth-table"]
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("always")
            s = train(parse_args(argv))
        if pycomm.rank() == 0:
            print("RESULT " + json.dumps({
                "key": k, "status": "ok", "accuracy": round(s["final_test_accuracy"], 2),
                "final_train_loss": round(s["final_train_loss"], 4), "epochs": s["epochs"], "lr": s["lr"],
                "train_s": round(time.perf_counter() - t0, 1),
                "chance_warning": any("at chance level" in str(w.message) for w in caught)}), flush=True)


def run_chunk(keys: List[str], np_: int, timeout_s: float, deadline: Optional[float], on_result) -> None:
    """One pycomm-run job over `keys`; on_result(key, record) as each finishes. A cell whose job died (or ran
    past timeout_s) is recorded as failed with the job's last error line; the caller runs the rest again.
    Past `deadline` (time.time()) the job is stopped between two cells."""
    import threading

    cmd = [sys.executable, "-m", "pycomm.tools.launcher", "-np", str(np_), "--", sys.executable, os.path.abspath(__file__),
           "--worker", ",".join(keys)]
    with tempfile.TemporaryFile("w+") as errf:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=errf, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        state = {"current": None, "t0": time.time(), "timed_out": False}

        def watchdog():
            while p.poll() is None:
                if state["current"] is not None and time.time() - state["t0"] > timeout_s:
                    state["timed_out"] = True
                    os.killpg(p.pid, 9)
                    return
                time.sleep(2)

        threading.Thread(target=watchdog, daemon=True).start()
        for line in p.stdout:
            if line.startswith("START "):
                state["t0"], state["current"] = time.time(), line.split()[1]
            elif line.startswith("RESULT "):
                rec = json.loads(line[7:])
                state["current"] = None
                on_result(rec.pop("key"), {**rec, "commit": git_commit(), "np": np_})
                if deadline is not None and time.time() > deadline:
                    os.killpg(p.pid, 9)
                    break
        rc = p.wait()
        current = state["current"]
        if current is not None:
            errf.seek(0)
            errs = [ln.strip() for ln in errf.read().splitlines() if "error" in ln.lower()]
            msg = f"no result within {timeout_s:g} s" if state["timed_out"] else (
                errs[-1] if errs else f"the job ended with status {rc}")
            on_result(current, {"status": "failed", "returncode": rc, "commit": git_commit(), "np": np_,
                                "message": msg[:400]})


def table(results: Dict[str, dict], threshold: float) -> str:
    refusals: List[str] = []

    def note(msg: str) -> int:
        if msg not in refusals:
            refusals.append(msg)
        return refusals.index(msg) + 1

    cols = list(itertools.product(PRECISIONS, COMPRESSIONS))
    lines = ["| algorithm | optimizer | " + " | ".join(f"{p} / {c}" for p, c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    counts = {"ok": 0, "below": 0, "refused": 0, "failed": 0, "not run": 0}
    for algo in algorithms():
        for opt in OPTIMIZERS:
            row = []
            for prec, comp in cols:
                cell = (algo, opt, prec, comp)
                msg = refusal(cell)  # asked afresh: the refusals are pycomm-train's current checks
                r = {"status": "refused", "message": msg} if msg is not None else results.get(key(cell))
                if r is None:
                    row.append("not run")
                    counts["not run"] += 1
                elif r["status"] == "ok":
                    low = r["accuracy"] < threshold
                    counts["below" if low else "ok"] += 1
                    row.append(f"{r['accuracy']:.2f}" + (" !" if low else "") + (" w" if r.get("chance_warning") else ""))
                elif r["status"] == "refused":
                    counts["refused"] += 1
                    row.append(f"refused [{note(r['message'])}]")
                else:
                    counts["failed"] += 1
                    row.append(f"FAILED ({r.get('returncode')})")
            lines.append(f"| {algo} | {opt} | " + " | ".join(row) + " |")
    lines.append("")
    lines.append("! below the target; w: the run printed pycomm-train's chance-level warning.")
    lines.append("")
    lines.append(f"Allowed and run: {counts['ok'] + counts['below']} ({counts['ok']} at >= {threshold:g}%, "
                 f"{counts['below']} below, marked !); failed: {counts['failed']}; refused at start: "
                 f"{counts['refused']}; not run yet: {counts['not run']}.")
    lines.append("")
    lines.append("Refusal messages (pycomm-train's own, printed at start on every rank before any training):")
    lines.append("")
    for i, msg in enumerate(refusals, 1):
        lines.append(f"{i}. {msg}")
    return "\n".join(lines) + "\n"


def summary(results: Dict[str, dict], threshold: float) -> str:
    """The fp32 / no-compression column of the table, algorithms x optimizers (the README's view), with the
    count over every allowed cell."""
    lines = ["| algorithm | " + " | ".join(OPTIMIZERS) + " |", "|---|" + "---|" * len(OPTIMIZERS)]
    ok = allowed = 0
    for algo in algorithms():
        row = []
        for opt in OPTIMIZERS:
            cell = (algo, opt, "fp32", "none")
            r = results.get(key(cell)) if refusal(cell) is None else None
            row.append("refused" if refusal(cell) is not None else "not run" if r is None or r["status"] != "ok"
                       else f"{r['accuracy']:.1f}")
        lines.append(f"| {algo} | " + " | ".join(row) + " |")
    for c in cells():
        if refusal(c) is None:
            allowed += 1
            r = results.get(key(c))
            ok += bool(r and r["status"] == "ok" and r["accuracy"] >= threshold)
    lines.append("")
    lines.append(f"fp32, no compression. Every allowed combination of precision and compression too: {ok} of "
                 f"{allowed} at >= {threshold:g}%; the rest are refused at start with the reason.")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--results", default=DEFAULT_RESULTS)
    p.add_argument("--markdown", default=DEFAULT_MARKDOWN, help="write the table here ('' to skip)")
    p.add_argument("--max-runs", type=int, default=None, help="run at most this many cells, then print the table")
    p.add_argument("--max-minutes", type=float, default=None, help="start no run after this many minutes")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one cell may take")
    p.add_argument("--threshold", type=float, default=85.0)
    p.add_argument("--retry-failed", action="store_true")
    p.add_argument("--table-only", action="store_true", help="print the table from the results file, run nothing")
    p.add_argument("--summary", action="store_true",
                   help="print only the fp32 / no-compression view (the README's table) from the results file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker is not None:
        worker(opts.worker.split(","))
        return 0
    results = load(opts.results)
    if opts.summary:
        print(summary(results, opts.threshold), end="")
        return 0
    meta = {"np": opts.np, "dataset": "digits", "command": "python bench/matrix.py"}
    t0 = time.time()
    if not opts.table_only:
        todo = [key(c) for c in cells() if refusal(c) is None and (
            key(c) not in results or (opts.retry_failed and results[key(c)]["status"] == "failed"))]
        if opts.max_runs is not None:
            todo = todo[:opts.max_runs]
        print(f"matrix: {len(todo)} cell(s) to run", flush=True)

        def on_result(k, rec):
            results[k] = rec
            save(opts.results, results, meta)
            todo.remove(k)
            print(f"matrix: {k}: {rec['status']} {rec.get('accuracy', rec.get('message', ''))}", flush=True)

        while todo and (opts.max_minutes is None or time.time() - t0 < 60 * opts.max_minutes):
            before = len(todo)
            deadline = None if opts.max_minutes is None else t0 + 60 * opts.max_minutes
            run_chunk(list(todo), opts.np, opts.timeout, deadline, on_result)
            if len(todo) == before:  # the job ran no cell (died at start, or the deadline): stop
                print("matrix: the job ran no cell; stopping", file=sys.stderr)
                break
    text = table(results, opts.threshold)
    print(text)
    if opts.markdown:
        with open(opts.markdown, "w") as f:
            f.write("# pycomm-train at its defaults: every combination\n\n"
                    f"{opts.np} ranks, `--dataset digits`, every other option at pycomm-train's default (mlp, batch "
                    "16 per rank, 5 epochs, seed 0). Final test accuracy in percent (359 test images: one image is "
                    "0.28 points). Printed by `python bench/matrix.py` (results in bench/results/matrix.json; a "
                    "rerun fills in only the cells without a result).\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
