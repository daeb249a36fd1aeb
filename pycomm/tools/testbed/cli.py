"""`pycomm-testbed` command line, and `relaunch` for programs with a --testbed option."""
from __future__ import annotations

import argparse
import shlex
import signal
import sys
from typing import List, Mapping, Optional, Sequence

from ..launcher import find_launcher, mpi_flavour
from .plan import (
    BedSpec,
    DEFAULT_NAME,
    STATE_DIR,
    TestbedError,
    check_layout,
    job_env,
    mpi_command,
    parse_shape,
)
from .system import Testbed, _pid_alive, beds, create, destroy, link_bytes, load, run_job

def relaunch(shape: str, link_gbps: float, argv: Optional[Sequence[str]] = None,
             drop: Sequence[str] = ("--testbed",), env: Optional[Mapping[str, str]] = None) -> int:
    """Re-run this program (or `argv`) inside a fresh bed of shape 'HOSTSxRANKS' and return its exit code.

    For benchmarks with a ``--testbed 2x2 --link-gbps 1`` option::

        if args.testbed and not os.environ.get("PYCOMM_TESTBED"):
            sys.exit(pycomm.tools.testbed.relaunch(args.testbed, args.link_gbps))

    The options named in `drop` (with their values) are removed from the relaunched command line;
    ``--link-gbps`` stays so that the program inside can put the rate into its model. The bed is
    removed when the job ends, also on failure and Ctrl-C.
    """
    hosts, rph = parse_shape(shape)
    if argv is None:
        argv = [sys.executable, *sys.argv]
    argv = _drop_options(list(argv), drop)
    with Testbed(hosts=hosts, link_gbps=link_gbps) as bed:
        return bed.run(hosts * rph, argv, ranks_per_host=rph, env=env).returncode


def _drop_options(argv: List[str], names: Sequence[str]) -> List[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pycomm-testbed",
                                description="Emulated hosts on one machine (network namespaces, shaped links) "
                                            "for multi-node MPI jobs.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add_bed(q, one_shot=False):
        q.add_argument("--hosts", type=int, default=None if one_shot else 2, help="number of hosts [2]")
        q.add_argument("--link-gbps", type=float, default=None if one_shot else 1.0,
                       help="egress rate of each host in Gbit/s [1]")

    up = sub.add_parser("up", help="create a bed that stays up until `down`")
    up.add_argument("--name", default=DEFAULT_NAME)
    add_bed(up)
    down = sub.add_parser("down", help="remove a bed and everything it created")
    g = down.add_mutually_exclusive_group()
    g.add_argument("--name", default=DEFAULT_NAME)
    g.add_argument("--all", action="store_true", help="every bed recorded under " + STATE_DIR)
    st = sub.add_parser("status", help="list beds and the bytes sent over each host's link")
    st.add_argument("--name", default=None)
    run = sub.add_parser("run", help="run an MPI job across the hosts (one-shot bed when none is up)",
                         usage="pycomm-testbed run [--name N] [--hosts H] [--link-gbps G] [-np N] "
                               "[--ranks-per-host R] [--timeout S] [--dry-run] -- command ...")
    run.add_argument("--name", default=DEFAULT_NAME, help="use this bed when it is up [pycomm]")
    add_bed(run, one_shot=True)
    run.add_argument("-np", "-n", dest="np", type=int, default=None, help="ranks [hosts x ranks-per-host]")
    run.add_argument("--ranks-per-host", type=int, default=None, help="ranks per host [ceil(np / hosts), else 1]")
    run.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
    run.add_argument("--launcher", default=None, help="mpirun/mpiexec to use (default: this environment's)")
    run.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                     help="extra launcher argument (repeatable)")
    run.add_argument("--dry-run", action="store_true", help="print the launcher command for a bed; create nothing")
    run.add_argument("command", nargs=argparse.REMAINDER)
    return p


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)


def _status(name: Optional[str]) -> int:
    specs = [s for s in beds() if name is None or s.name == name]
    if not specs:
        print("no beds up" if name is None else f"no bed named {name} is up")
        return 0 if name is None else 1
    for s in specs:
        owner = "persistent" if s.persistent else f"owner pid {s.owner_pid}" + (
            "" if _pid_alive(s.owner_pid) else " (gone: stale)")
        print(f"{s.name}: {s.hosts} hosts, {s.link_gbps:g} Gbit/s per host egress, subnet {s.subnet}, {owner}")
        try:
            counts = link_bytes(s)
        except TestbedError as e:
            counts = {}
            print(f"  cannot read counters: {e}")
        for i, ns in enumerate(s.namespaces):
            sent = counts.get(ns)
            print(f"  {ns}  {s.addr(i):<15} sent {sent if sent is not None else '?'} bytes")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _sigterm_to_exit)
    try:
        if args.cmd == "up":
            spec = create(args.name, args.hosts, args.link_gbps, persistent=True)
            print(f"pycomm-testbed: bed {spec.name} up: {spec.hosts} hosts ({', '.join(spec.namespaces)}) on "
                  f"{spec.subnet}, {spec.link_gbps:g} Gbit/s egress each; `pycomm-testbed down --name {spec.name}` "
                  "removes it")
            return 0
        if args.cmd == "down":
            names = [s.name for s in beds()] if args.all else [args.name]
            for n in names:
                destroy(n)
                print(f"pycomm-testbed: bed {n} removed")
            return 0
        if args.cmd == "status":
            return _status(args.name)
        return _cli_run(args)
    except (TestbedError, ValueError) as e:
        print(f"pycomm-testbed: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _cli_run(args) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("no command given (e.g. pycomm-testbed run -np 4 -- python x.py)")
    existing = load(args.name)
    if existing is not None:
        for opt, want, have in (("--hosts", args.hosts, existing.hosts), ("--link-gbps", args.link_gbps,
                                                                         existing.link_gbps)):
            if want is not None and want != have:
                raise ValueError(f"bed {args.name} is up with {opt} {have:g}, not {want:g}; "
                                 f"`pycomm-testbed down --name {args.name}` or drop {opt}")
    hosts = args.hosts if args.hosts is not None else 2
    link = args.link_gbps if args.link_gbps is not None else 1.0
    rph = args.ranks_per_host
    if args.np is not None and rph is None:
        rph = max(1, -(-args.np // (existing.hosts if existing else hosts)))
    rph = rph or 1
    np = args.np if args.np is not None else (existing.hosts if existing else hosts) * rph
    if args.dry_run:
        spec = existing or BedSpec(name=args.name, hosts=hosts, link_gbps=link, subnet_index=0)
        launcher = find_launcher(args.launcher)
        if command[0] in ("python", "python3"):
            command[0] = sys.executable
        cmd, launch_env = mpi_command(spec, np, command, ranks_per_host=rph, launcher=launcher,
                                      flavour=mpi_flavour(launcher), env=job_env(None, spec, np),
                                      extra=args.mpi_arg)
        print(" ".join(f"{k}={v}" for k, v in launch_env.items()) + (" " if launch_env else "") + shlex.join(cmd))
        return 0
    check_layout(existing.hosts if existing else hosts, np, rph)
    if existing is not None:
        before = link_bytes(existing)
        rc = run_job(existing, np, command, ranks_per_host=rph, launcher=args.launcher, timeout=args.timeout,
                     extra=args.mpi_arg).returncode
        after = link_bytes(existing)
        print("pycomm-testbed: bytes sent over the links during the job: "
              + ", ".join(f"{h} {after[h] - before[h]}" for h in after), file=sys.stderr, flush=True)
        return rc
    # One-shot: a bed of our own, removed whatever happens.
    with Testbed(hosts=hosts, link_gbps=link) as bed:
        print(f"pycomm-testbed: one-shot bed {bed.name}: {hosts} hosts on {bed.subnet}, {link:g} Gbit/s",
              file=sys.stderr, flush=True)
        rc = run_job(bed.spec, np, command, ranks_per_host=rph, launcher=args.launcher, timeout=args.timeout,
                     extra=args.mpi_arg).returncode
        sent = bed.link_bytes()
        print("pycomm-testbed: bytes sent over the links: " + ", ".join(f"{h} {b}" for h, b in sent.items()),
              file=sys.stderr, flush=True)
        return rc


if __name__ == "__main__":
    sys.exit(main())

