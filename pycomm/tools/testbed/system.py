"""The system side of a test bed: checks, state files, namespaces, creation and teardown, running a job."""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..launcher import find_launcher, mpi_flavour
from .plan import (
    BedSpec,
    DEFAULT_NAME,
    STATE_DIR,
    SUBNET_BASE,
    TestbedError,
    agent_script,
    hostfile_text,
    job_env,
    mpi_command,
    parse_qdisc_bytes,
    setup_commands,
    teardown_commands,
    validate_name,
)


# --------------------------------------------------------------------------- system side


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise TestbedError(f"{argv[0]} not found; install iproute2 (ip, tc) and util-linux (unshare)") from None
    if check and out.returncode != 0:
        raise TestbedError(f"`{shlex.join(argv)}` failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()}")
    return out


_PROBE = ("ip link add pyctbA type veth peer name pyctbB && ip link add pyctbR type bridge && "
          "ip link set pyctbA master pyctbR && "
          "tc qdisc add dev pyctbB root tbf rate 1gbit burst 65536 latency 50ms")


def available() -> Tuple[bool, str]:
    """(True, '') when this machine can host a bed, else (False, the reason). Changes nothing outside a
    throwaway network namespace."""
    if not sys.platform.startswith("linux"):
        return False, "pycomm-testbed needs Linux network namespaces"
    if os.geteuid() != 0:
        return False, "pycomm-testbed needs root (network namespaces, veth, tc); run as root or in a root container"
    try:
        with open("/proc/self/uid_map") as f:
            uid_map = f.read().split()
        with open("/proc/self/status") as f:
            cap_eff = int(re.search(r"^CapEff:\s*([0-9a-f]+)", f.read(), re.M).group(1), 16)
    except (OSError, AttributeError):
        uid_map, cap_eff = [], 0
    if uid_map[:3] != ["0", "0", "4294967295"]:
        return False, ("pycomm-testbed needs root of the machine (or of a privileged container); this root is "
                       "mapped in a user namespace (rootless container?) and cannot add interfaces to this "
                       "network namespace")
    missing = [name for bit, name in ((12, "CAP_NET_ADMIN"), (21, "CAP_SYS_ADMIN")) if not cap_eff >> bit & 1]
    if missing:
        return False, f"pycomm-testbed needs {' and '.join(missing)} (run the container with --privileged)"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found: install {pkg} (apt-get install {pkg})"
    try:
        out = subprocess.run(["unshare", "--net", "--uts", "sh", "-c", _PROBE], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot create a network namespace: {e}"
    if out.returncode != 0:
        return False, ("cannot create a network namespace with a bridge, veth pair and tbf qdisc here "
                       f"(a container without CAP_SYS_ADMIN/CAP_NET_ADMIN?): {(out.stderr or out.stdout).strip()}")
    return True, ""


def _require_available() -> None:
    ok, why = available()
    if not ok:
        raise TestbedError(why)


@contextlib.contextmanager
def _lock():
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(os.path.join(STATE_DIR, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load(name: str) -> Optional[BedSpec]:
    path = os.path.join(STATE_DIR, f"{validate_name(name)}.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    return BedSpec(**data)


def _save(spec: BedSpec) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = spec.state_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(spec), f, indent=1)
    os.replace(tmp, spec.state_file)


def beds() -> List[BedSpec]:
    if not os.path.isdir(STATE_DIR):
        return []
    out = []
    for fn in sorted(os.listdir(STATE_DIR)):
        if fn.endswith(".json"):
            spec = load(fn[:-5])
            if spec is not None:
                out.append(spec)
    return out


def _used_subnets() -> set:
    """Third octets of 10.77.X.0/24 that overlap an address or route here, or another bed."""
    used = {b.subnet_index for b in beds()}
    nets = []
    for argv in (["ip", "-o", "-4", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        text = _run(argv, check=False).stdout
        for tok in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", text):
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_network(tok, strict=False))
    for x in range(256):
        mine = ipaddress.ip_network(f"{SUBNET_BASE}.{x}.0/24")
        if any(mine.overlaps(n) for n in nets):
            used.add(x)
    return used


def _existing_names() -> Tuple[set, set]:
    ns = {line.split()[0] for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines() if line.strip()}
    links = set(re.findall(r"^\d+:\s+([^:@\s]+)", _run(["ip", "-o", "link", "show"], check=False).stdout, re.M))
    return ns, links


def _kill_namespace_processes(namespaces: Sequence[str]) -> None:
    """End the processes left inside the bed's namespaces (a dead job's daemons and ranks): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 1.0)):
        pids = set()
        for ns in namespaces:
            out = _run(["ip", "netns", "pids", ns], check=False)
            pids |= {int(p) for p in out.stdout.split() if p.isdigit()}
        pids.discard(os.getpid())
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)


@contextlib.contextmanager
def _signals_held():
    """Hold Ctrl-C/TERM/HUP back while a teardown runs, so that a second Ctrl-C cannot leave half a bed."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _teardown(spec: BedSpec) -> List[str]:
    """Remove what `spec.created` lists; return the errors (teardown goes on past them)."""
    with _signals_held():
        return _teardown_now(spec)


def _teardown_now(spec: BedSpec) -> List[str]:
    errors = []
    _kill_namespace_processes([n for k, n in spec.created if k == "netns"])
    for argv in teardown_commands(spec.created):
        out = _run(argv, check=False)
        if out.returncode != 0 and "Cannot find device" not in out.stderr and "No such file" not in out.stderr:
            errors.append(f"`{shlex.join(argv)}`: {out.stderr.strip()}")
    # veth/bridge removal is asynchronous in the kernel; wait so that the next bed can reuse the names.
    links = [n for k, n in spec.created if k == "link"]
    deadline = time.monotonic() + 5
    while links and time.monotonic() < deadline:
        present = _existing_names()[1]
        if not any(n in present for n in links):
            break
        time.sleep(0.05)
    shutil.rmtree(spec.state_dir, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(spec.state_file)
    return errors


def _cleanup_stale() -> None:
    """Remove non-persistent beds whose owning process is gone (killed hard before it could clean up)."""
    for spec in beds():
        if not spec.persistent and not _pid_alive(spec.owner_pid):
            print(f"pycomm-testbed: removing stale bed {spec.name} (owner pid {spec.owner_pid} is gone)",
                  file=sys.stderr)
            _teardown(spec)


def create(name: str, hosts: int = 2, link_gbps: float = 1.0, persistent: bool = False) -> BedSpec:
    """Create a bed; on any failure remove what was created and raise TestbedError."""
    BedSpec(name=name, hosts=hosts, link_gbps=link_gbps, subnet_index=0)  # validate before touching anything
    _require_available()
    with _lock():
        _cleanup_stale()
        if load(name) is not None:
            raise TestbedError(f"a bed named {name} is already up; `pycomm-testbed down --name {name}` first "
                               "or choose another --name")
        used = _used_subnets()
        free = [x for x in range(256) if x not in used]
        if not free:
            raise TestbedError(f"no free /24 left in {SUBNET_BASE}.0.0/16 on this machine")
        spec = BedSpec(name=name, hosts=hosts, link_gbps=link_gbps, subnet_index=free[0], persistent=persistent,
                       owner_pid=0 if persistent else os.getpid())
        ns_names, link_names = _existing_names()
        clash = [n for n in spec.namespaces if n in ns_names]
        clash += [n for n in [spec.bridge] + [spec.veth(i) for i in range(hosts)] if n in link_names]
        if clash:
            raise TestbedError(f"names of bed {name} are taken by objects it did not create: {', '.join(clash)}; "
                               "choose another --name")
        _save(spec)  # before the first change, so that a crash leaves a record teardown can use
        try:
            for kind, obj, argv in setup_commands(spec):
                with _signals_held():  # an object is recorded if and only if this bed created it
                    _run(argv)
                    if kind:
                        spec.created.append([kind, obj])
                        _save(spec)
            os.makedirs(spec.state_dir, exist_ok=True)
            with open(spec.agent, "w") as f:
                f.write(agent_script(spec))
            os.chmod(spec.agent, 0o755)
            _save(spec)
        except BaseException:
            _teardown(spec)
            raise
    return spec


def destroy(name: str) -> None:
    spec = load(name)
    if spec is None:
        raise TestbedError(f"no bed named {name} is up (see `pycomm-testbed status`)")
    with _lock():
        errors = _teardown(spec)
    if errors:
        raise TestbedError(f"bed {name} removed with errors:\n" + "\n".join(errors))


def link_bytes(spec: BedSpec) -> Dict[str, int]:
    """Bytes each host has sent through its shaped egress (its tbf qdisc), by host name."""
    return {ns: parse_qdisc_bytes(_run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", "eth0"]).stdout)
            for ns in spec.namespaces}


def run_job(spec: BedSpec, np: Optional[int], argv: Sequence[str], *, ranks_per_host: Optional[int] = None,
            env: Optional[Mapping[str, str]] = None, launcher: Optional[str] = None, timeout: Optional[float] = None,
            capture: bool = False, extra: Sequence[str] = (), cwd: Optional[str] = None,
            verbose: bool = True) -> subprocess.CompletedProcess:
    """Run `argv` on `np` ranks spread over the bed's hosts (`ranks_per_host` per host, filled in order).

    Returns the CompletedProcess (stdout holds stdout+stderr when capture=True). On timeout, Ctrl-C or
    failure the whole job is ended, also what is left of it inside the namespaces (so a bed runs one job
    at a time).
    """
    if ranks_per_host is None:
        ranks_per_host = max(1, -(-(np or spec.hosts) // spec.hosts))
    if np is None:
        np = spec.hosts * ranks_per_host
    argv = list(argv)
    if not argv:
        raise ValueError("no command given")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    launcher = find_launcher(launcher)
    flavour = mpi_flavour(launcher)
    full_env = job_env(env, spec, np)
    if verbose and (os.environ if env is None else env).get("PYCOMM_RANKS_PER_NODE"):
        print(f"pycomm-testbed[{spec.name}]: PYCOMM_RANKS_PER_NODE is not passed on: in the bed, nodes are the "
              "emulated hosts, as MPI sees them", file=sys.stderr, flush=True)
    cmd, launch_env = mpi_command(spec, np, argv, ranks_per_host=ranks_per_host, launcher=launcher,
                                  flavour=flavour, env=full_env, extra=extra)
    full_env.update(launch_env)
    os.makedirs(spec.state_dir, exist_ok=True)
    with open(spec.hostfile, "w") as f:
        f.write(hostfile_text(spec, ranks_per_host))
    if verbose:
        print(f"pycomm-testbed[{spec.name}]: " + shlex.join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, start_new_session=True,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.STDOUT if capture else None, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException as e:  # timeout, Ctrl-C, SystemExit from SIGTERM
        _end_job(proc, spec)
        out = proc.stdout.read() if (capture and proc.stdout) else None
        if isinstance(e, subprocess.TimeoutExpired):
            msg = f"\n*** pycomm-testbed: job killed after {timeout:.0f} s ***\n"
            return subprocess.CompletedProcess(cmd, 124, (out or "") + msg if capture else None)
        raise
    if proc.returncode != 0:  # daemons and ranks of a failed job may linger in the namespaces
        _kill_namespace_processes(spec.namespaces)
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _end_job(proc: subprocess.Popen, spec: BedSpec) -> None:
    for sig, wait in ((signal.SIGINT, 3), (signal.SIGTERM, 2), (signal.SIGKILL, 2)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
    _kill_namespace_processes(spec.namespaces)


# --------------------------------------------------------------------------- Python API


class Testbed:
    """A bed for the duration of a `with` block (or until close()).

    ``Testbed(hosts=2, link_gbps=1)`` creates namespaces named after this process
    (``pyc<pid>h0``...) so that concurrent users do not collide; ``name=`` picks
    another name. ``Testbed.attach(name)`` uses a bed made by `pycomm-testbed up`
    without removing it.
    """

    __test__ = False

    def __init__(self, hosts: int = 2, link_gbps: float = 1.0, name: Optional[str] = None):
        self.name = name or f"pyc{os.getpid() % 10_000_000}"
        self.hosts = hosts
        self.link_gbps = link_gbps
        self.spec: Optional[BedSpec] = None
        self._owned = True

    @classmethod
    def attach(cls, name: str = DEFAULT_NAME) -> "Testbed":
        spec = load(name)
        if spec is None:
            raise TestbedError(f"no bed named {name} is up; `pycomm-testbed up --name {name}`")
        bed = cls(spec.hosts, spec.link_gbps, name)
        bed.spec, bed._owned = spec, False
        return bed

    def up(self) -> "Testbed":
        if self.spec is None:
            self.spec = create(self.name, self.hosts, self.link_gbps)
        return self

    def close(self) -> None:
        if self.spec is not None and self._owned:
            spec, self.spec = self.spec, None
            with _lock():
                errors = _teardown(spec)
            if errors:
                raise TestbedError("teardown errors:\n" + "\n".join(errors))

    def __enter__(self) -> "Testbed":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.close()

    def _spec(self) -> BedSpec:
        if self.spec is None:
            raise TestbedError("the bed is not up; use `with Testbed(...) as bed:` or bed.up()")
        return self.spec

    @property
    def subnet(self) -> str:
        return self._spec().subnet

    def run(self, np: Optional[int], argv: Sequence[str], ranks_per_host: Optional[int] = None,
            env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None, capture: bool = False,
            **kw) -> subprocess.CompletedProcess:
        """Run `argv` on `np` ranks across the hosts; see run_job."""
        return run_job(self._spec(), np, argv, ranks_per_host=ranks_per_host, env=env, timeout=timeout,
                       capture=capture, **kw)

    def link_bytes(self) -> Dict[str, int]:
        """Bytes each host has sent over its shaped link so far (tbf qdisc counter), by host name."""
        return link_bytes(self._spec())


