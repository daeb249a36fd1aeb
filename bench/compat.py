"""Other people's tests on pycomm: Horovod's test_torch.py and torch's DistributedTest, one table.

    python bench/compat.py                       # both suites at 2 ranks
    python bench/compat.py --ranks 2,3,4 --suites horovod,torch,torch-gloo --json out.json

Suites:
  horovod     Horovod's test/parallel/test_torch.py, unchanged, from ../shared/peer/horovod
              (HOROVOD_TESTS=DIR elsewhere), in one pytest job per world size, with
              `import horovod.torch` resolving to pycomm.horovod (tests/compat/alias).
  torch       torch's DistributedTest with backend "pycomm" (tests/compat/torch_dist.py).
  torch-gloo  the same tests on gloo, the reference that docs/compatibility.md compares with.

Each row counts a test as passed when it passed on every rank, failed when it
failed on any (or the job ended while it ran), skipped otherwise. When a job
ends inside a test (a crash, or a test past its time limit), that test counts
as failed and a new job continues after it. Prints one table; --json writes
every test's outcome with its message.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPAT = os.path.join(ROOT, "tests", "compat")
HOROVOD_DIR = os.environ.get("HOROVOD_TESTS", os.path.join(os.path.dirname(ROOT), "shared", "peer", "horovod"))
HOROVOD_FILE = os.path.join(HOROVOD_DIR, "parallel", "test_torch.py")


def horovod_missing() -> str:
    """Why the Horovod suite cannot run here ('' when it can)."""
    if not os.path.isfile(HOROVOD_FILE):
        return (f"Horovod's test suite is not at {HOROVOD_FILE} (it comes from ../shared/peer/horovod beside the "
                "repository, or HOROVOD_TESTS=DIR; a clone on its own does not have it)")
    for module in ("mock", "cloudpickle"):
        try:
            __import__(module)
        except ImportError:
            return f"Horovod's test suite imports {module!r}: pip install -r requirements-dev.txt"
    return ""


def _mpirun(np: int, args: List[str], env: Dict[str, str], timeout: float) -> Tuple[int, str]:
    # pycomm/tools/launcher.py on its own (standard library only): the orchestrator imports neither torch nor pycomm.
    import importlib.util

    spec = importlib.util.spec_from_file_location("pycomm_launcher", os.path.join(ROOT, "pycomm", "tools", "launcher.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    build_command, find_launcher, mpi_flavour = mod.build_command, mod.find_launcher, mod.mpi_flavour
    launcher = find_launcher()
    full = dict(os.environ)
    full.update(env)
    full.setdefault("OMP_NUM_THREADS", "1")
    full["PYTHONUNBUFFERED"] = "1"
    cmd = build_command(np, [sys.executable, *args], launcher=launcher, flavour=mpi_flavour(launcher), env=full)
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout, start_new_session=True)
        return p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        return -9, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")


def _read(out_dir: str, np: int) -> Tuple[Dict[str, List[dict]], set]:
    """Per test, each rank's final record; and the tests some rank started but did not finish."""
    results: Dict[str, List[dict]] = {}
    started = set()
    for r in range(np):
        path = os.path.join(out_dir, f"{r}.jsonl")
        if not os.path.exists(path):
            continue
        open_tests = set()
        for line in open(path):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec["event"] == "start":
                open_tests.add(rec["test"])
            else:
                open_tests.discard(rec["test"])
                results.setdefault(rec["test"], []).append(rec)
        started |= open_tests
    return results, started


def _outcome(recs: List[dict]) -> Tuple[str, str]:
    events = [r["event"] for r in recs]
    msgs = [r.get("msg", "") for r in recs if r.get("msg")]
    if "failed" in events:
        return "failed", next((r.get("msg", "") for r in recs if r["event"] == "failed"), "")
    if "skipped" in events:
        return "skipped", msgs[0] if msgs else ""
    return "passed", ""


def run_suite(suite: str, np: int, job_timeout: float, test_timeout: float, log) -> Dict[str, Tuple[str, str]]:
    """Run one suite at np ranks; {test: (outcome, message)}."""
    out_dir = tempfile.mkdtemp(prefix=f"pycomm_compat_{suite}_{np}_")
    final: Dict[str, Tuple[str, str]] = {}
    all_tests = None
    if suite.startswith("torch"):
        lst = subprocess.run([sys.executable, os.path.join(COMPAT, "torch_dist.py"), "--list", "--out", out_dir,
                              "--backend", "gloo"], capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "OMPI_MCA_ess_singleton_isolated": "1"})
        all_tests = lst.stdout.split()
        if not all_tests:
            raise RuntimeError(f"compat: could not list torch's tests:\n{lst.stdout}\n{lst.stderr}")
    if suite == "horovod":
        # unittest's order (by name), the order pytest runs a TestCase in
        all_tests = sorted(re.findall(r"^    def (test_\w+)\(self", open(HOROVOD_FILE).read(), re.M))
    for attempt in range(200):
        rest = [t for t in all_tests if t not in final]
        if not rest:
            break
        job_dir = os.path.join(out_dir, f"job{attempt}")
        os.makedirs(job_dir)
        if suite == "horovod":
            # The whole file in the first job; after a job ended inside a test, the tests after it by node id.
            targets = [HOROVOD_FILE] if not final else [f"{HOROVOD_FILE}::TorchTests::{t}" for t in rest]
            args = ["-m", "pytest", *targets, "-q", "-p", "no:cacheprovider", "-p", "record", "--color=no",
                    f"--timeout={test_timeout:.0f}", "--rootdir", HOROVOD_DIR]
            # A test that leaves one rank waiting for a collective the others never call ends the job
            # through pycomm's stall watchdog after 10 s (the next job resumes after that test).
            env = {"PYTHONPATH": os.pathsep.join([os.path.join(COMPAT, "alias"), COMPAT, ROOT]),
                   "PYCOMM_COMPAT_OUT": job_dir, "PYCOMM_STALL_WARNING_S": "5", "PYCOMM_STALL_ABORT_S": "10"}
        else:
            args = [os.path.join(COMPAT, "torch_dist.py"), "--backend", "gloo" if suite == "torch-gloo" else "pycomm",
                    "--out", job_dir, "--tests", ",".join(rest), f"--test-timeout={test_timeout:.0f}"]
            env = {"PYTHONPATH": os.pathsep.join([ROOT, COMPAT]), "PYCOMM_STALL_WARNING_S": "10",
                   "PYCOMM_STALL_ABORT_S": "60"}
        t0 = time.time()
        rc, text = _mpirun(np, args, env, job_timeout)
        results, started = _read(job_dir, np)
        open_tests = sorted((t for t in started if t in all_tests), key=all_tests.index)
        for t, recs in results.items():
            if t in open_tests:
                continue  # some rank was still inside it when the job ended
            if suite.startswith("torch") or len(recs) == np:
                final[t] = _outcome(recs)
        # The job ended inside the first test some rank had not finished; ranks that had gone on to
        # later tests only waited there, so those run again in the next job.
        crashed = open_tests[:1]
        for t in crashed:
            final[t] = ("failed", f"the job ended during this test (exit {rc})" +
                        "".join(f"; {r.get('msg', '')}" for r in results.get(t, []) if r.get("msg")))
        log(f"# {suite} at {np} ranks: job {attempt} exit {rc} after {time.time() - t0:.0f} s, "
            f"{len(results)} tests reported" + (f", ended inside {crashed[0]}" if crashed else ""))
        if not crashed:
            if rc not in (0, 1) and not results:
                raise RuntimeError(f"compat: {suite} at {np} ranks did not start:\n{text[-4000:]}")
            for t in all_tests:  # a clean end: what did not report did not run (deselected by the suite)
                if t not in final and suite.startswith("torch"):
                    final[t] = ("failed", "no result")
            break
    shutil.rmtree(out_dir, ignore_errors=True)
    return final


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2")
    ap.add_argument("--suites", default="horovod,torch")
    ap.add_argument("--json", default="")
    ap.add_argument("--job-timeout", type=float, default=1800)
    ap.add_argument("--test-timeout", type=float, default=120)
    ap.add_argument("--failures", action="store_true", help="list every failed test with its message")
    args = ap.parse_args()
    rows, report = [], {}
    for suite in args.suites.split(","):
        for np in [int(n) for n in args.ranks.split(",")]:
            if suite == "horovod" and horovod_missing():
                print(f"# horovod: skipped: {horovod_missing()}", flush=True)
                continue
            t0 = time.time()
            res = run_suite(suite, np, args.job_timeout, args.test_timeout, lambda s: print(s, flush=True))
            counts = {k: sum(1 for o, _ in res.values() if o == k) for k in ("passed", "failed", "skipped")}
            rows.append((suite, np, counts["passed"], counts["failed"], counts["skipped"], time.time() - t0))
            report[f"{suite}/{np}"] = {t: {"outcome": o, "msg": m} for t, (o, m) in sorted(res.items())}
            if args.failures:
                for t, (o, m) in sorted(res.items()):
                    if o == "failed":
                        print(f"#   FAILED {suite}/{np} {t}: {m.splitlines()[-1] if m.strip() else ''}"[:300])
    print(f"{'suite':<12} {'ranks':>5} {'passed':>7} {'failed':>7} {'skipped':>8} {'pass %':>7} {'seconds':>8}")
    for suite, np, p, f, s, sec in rows:
        pct = 100.0 * p / (p + f) if p + f else 100.0
        print(f"{suite:<12} {np:>5} {p:>7} {f:>7} {s:>8} {pct:>7.1f} {sec:>8.0f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "tests": report}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
