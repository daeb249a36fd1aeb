"""What bench/study_*.py share: run the study's worker under pycomm's launcher, collect the
records each run appends to a JSON-lines file, and write the table, the records and the plot."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh_results(out: str, name: str) -> str:
    """OUT/NAME.jsonl, emptied: the workers append one record per run."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    return path


def launch(name: str, np_: int, script: str, args: Sequence[str]) -> int:
    """`python script args` on np_ ranks through pycomm-run (one OpenMP thread a rank); its exit status."""
    cmd = [sys.executable, "-m", "pycomm.tools.launcher", "-np", str(np_), sys.executable, os.path.abspath(script), *args]
    rc = subprocess.call(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if rc != 0:
        print(f"{name}: {' '.join(cmd)} failed with status {rc}", file=sys.stderr)
    return rc


def read_records(path: str) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_outputs(out: str, name: str, table: str, records: List[dict],
                  plot: Optional[Callable[[List[dict], str], None]] = None) -> None:
    """OUT/NAME.md (the table), NAME.json (the records) and, with `plot`, NAME.png; prints the table."""
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(records, f, indent=1)
    written = [f"{name}.md", f"{name}.json"]
    if plot is not None:
        plot(records, os.path.join(out, f"{name}.png"))
        written.append(f"{name}.png")
    print()
    print(table)
    print(f"wrote {out}/{', '.join(written)}")


def train_quietly(argv: Sequence[str]) -> dict:
    """One pycomm-train run inside the study's MPI job, its per-epoch lines kept off the output; its summary."""
    import contextlib
    import io

    from pycomm.tools.train.cli import parse_args
    from pycomm.tools.train.loop import train

    with contextlib.redirect_stdout(io.StringIO()):
        return train(parse_args(list(argv)))


def stats(xs) -> tuple:
    """Mean and sample standard deviation (0 for one value)."""
    import numpy as np

    a = np.asarray(xs, dtype=float)
    return float(a.mean()), (float(a.std(ddof=1)) if len(a) > 1 else 0.0)


def append_record(out, rec: dict) -> None:
    """One JSON line per run, flushed at once, so an interrupted study keeps every finished run."""
    out.write(json.dumps(rec) + "\n")
    out.flush()


def time_to(rec: dict, target: float) -> Optional[float]:
    """Wall time at which a run's evaluation curve first reached `target` accuracy, or None."""
    for pt in rec.get("curve", []):
        if pt["test_accuracy"] >= target:
            return pt["wall_time_s"]
    return None


def add_job_arguments(p) -> None:
    """The options every study takes: the job (--np, --seeds), where results go (--out), and the hidden
    pair the launched job is run with (--worker, --results)."""
    import argparse

    p.add_argument("--np", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)

