"""Run pytest files under mpirun at a given world size (used by tests/test_parallel.py).

Every rank runs the same pytest session on the files. A failure on any rank
makes that rank exit non-zero at once (tests/parallel/conftest.py), which
makes mpirun tear the whole job down: a failing rank fails the run and never
hangs it. A wall-clock limit backs that up.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Dict, Optional, Sequence, Tuple

from pycomm.tools.launcher import build_command, find_launcher, mpi_flavour

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kill_processes_naming(marker: str) -> None:
    """The ranks of a killed job can outlive mpirun (Open MPI's daemon starts them in a session of its
    own), and a hung one would spin for the rest of the test run: end every process whose command line
    contains `marker` (the job's script or test file)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                named = os.fsencode(marker) in f.read()
            if named and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:  # gone already, or not ours
            pass


def kill_job(proc: subprocess.Popen, args) -> str:
    """End a timed-out job: mpirun's process group, then any rank left behind; returns its output."""
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    script = next((str(a) for a in args if str(a).endswith(".py")), None)
    if script:
        kill_processes_naming(script)
    return out or ""


def run_under_mpi(np: int, args, timeout: float = 600, env: Optional[Dict[str, str]] = None) -> Tuple[int, str]:
    """Launch `python args...` on `np` ranks; return (exit code, combined output)."""
    launcher = find_launcher()
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env["PYCOMM_UNDER_MPIRUN"] = "1"
    cmd = build_command(np, [sys.executable, *args], launcher=launcher, flavour=mpi_flavour(launcher), env=full_env)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = kill_job(proc, args)
        return -9, out + f"\n*** killed after {timeout:.0f} s: the job hung ***\n"
    return proc.returncode, out


def run_pytest_under_mpi(np: int, paths: Sequence[str], timeout: float = 600,
                         env: Optional[Dict[str, str]] = None, extra=()) -> Tuple[int, str]:
    """One pytest session over the files `paths` on every rank."""
    return run_under_mpi(np, ["-m", "pytest", *paths, "-q", "-x", "-p", "no:cacheprovider", "--color=no", "--timeout=240",
                              # no tests/parallel file uses hypothesis; its plugin costs ~0.7 s a rank to load
                              "-p", "no:hypothesispytest",
                              *extra], timeout=timeout, env=env)
