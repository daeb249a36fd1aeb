"""``pycomm-testbed``: several emulated hosts on one machine, joined by a real, rate-limited network.

    pycomm-testbed up [--name N] [--hosts 2] [--link-gbps 1]   create a bed that stays up
    pycomm-testbed status [--name N]                            list beds and their link byte counters
    pycomm-testbed run [--name N] [-np 4] [--ranks-per-host 2] -- python x.py
    pycomm-testbed down [--name N | --all]                      tear a bed down

``run`` uses the bed named N when it is up; otherwise it is the one-shot form:
it brings a bed up (``--hosts``, ``--link-gbps``), runs the job and always
tears the bed down again, also on failure and on Ctrl-C.

Each host is a network namespace with its own loopback and one ``eth0``,
a veth pair whose other end sits on a bridge in the root namespace. Addresses
come from a private /24 (``10.77.X.0/24``, the first X not in use here): hosts
are .1, .2, ... and the bridge is .254, so that mpirun can stay in the root
namespace. Every host's egress is limited by a tbf qdisc, so all inter-host
traffic crosses a shaped link; ``tc -s qdisc`` counts its bytes.

The launcher reaches a host through an agent script in place of ssh: it drops
ssh options and runs the command in the host's namespace under its own
hostname (``unshare --uts``). Open MPI gets the transport flags that make its
traffic really cross the link (``pml ob1``, ``btl tcp,sm,self`` restricted to
the test subnet, the same for the out-of-band channel, ``btl_tcp_links 2``) and
``mpi_yield_when_idle 1`` (busy polling starves ranks on a small machine).
MPICH (hydra) gets ``UCX_TLS=tcp,self``/``FI_PROVIDER=tcp`` on ``eth0``;
without them UCX would use shared memory between the "hosts".

Ranks see one node per host (MPI's shared-memory split), so
``PYCOMM_RANKS_PER_NODE`` is removed from the job's environment.

Python::

    with Testbed(hosts=2, link_gbps=1) as bed:
        before = bed.link_bytes()
        rc = bed.run(4, ["python", "x.py"], ranks_per_host=2)
        sent = {h: bed.link_bytes()[h] - before[h] for h in before}

Benchmarks: ``pycomm-testbed run --hosts 2 --ranks-per-host 2 --link-gbps 1 -- python bench/x.py ...``
runs any program inside a one-shot bed; a program with its own ``--testbed 2x2`` option calls
``relaunch("2x2", link_gbps)`` when ``PYCOMM_TESTBED`` is unset (see bench/testbed.py).

Requirements: root of the machine or of a privileged container (CAP_NET_ADMIN, CAP_SYS_ADMIN, not a
user namespace), the kernel's veth, bridge and sch_tbf, and on Debian the packages iproute2 and
util-linux. ``available()`` checks all of this without changing anything and says what is missing.

Everything the bed creates is named after it (namespaces ``<name>h0``..,
veths ``<name>v0``.., bridge ``<name>br``) and recorded in
``/run/pycomm-testbed/<name>.json``; teardown removes exactly those objects and
nothing else. Needs root, ``ip`` and ``tc`` (Debian: iproute2) and ``unshare``
(util-linux).
"""
from __future__ import annotations

import argparse
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
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .launcher import build_command, cpu_count, find_launcher, mpi_flavour

STATE_DIR = os.environ.get("PYCOMM_TESTBED_STATE_DIR", "/run/pycomm-testbed")
SUBNET_BASE = "10.77"  # beds use 10.77.X.0/24
DEFAULT_NAME = "pycomm"
NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")  # interface names are at most 15 characters: <name>br, <name>v12
MAX_HOSTS = 16
ENV_MARKER = "PYCOMM_TESTBED"  # set in the job's environment: the name of the bed it runs in


class TestbedError(RuntimeError):
    """The bed cannot be created, used or removed; the message says why and what to do."""

    __test__ = False  # not a pytest class


# --------------------------------------------------------------------------- specification (pure logic)


def _positive_rate(link_gbps: float) -> float:
    try:
        rate = float(link_gbps)
    except (TypeError, ValueError):
        raise ValueError(f"link_gbps must be a number of Gbit/s, got {link_gbps!r}") from None
    if not (rate > 0 and rate <= 400):
        raise ValueError(f"link_gbps must be in (0, 400] Gbit/s, got {link_gbps!r}")
    return rate


@dataclass
class BedSpec:
    """What a bed is made of. Every name and address here derives from (name, hosts, subnet_index)."""

    name: str
    hosts: int
    link_gbps: float
    subnet_index: int
    persistent: bool = False  # created by `up` (stays) rather than by a Testbed/one-shot run (owner_pid)
    owner_pid: int = 0
    created: List[List[str]] = field(default_factory=list)  # [kind, name] in creation order

    def __post_init__(self):
        validate_name(self.name)
        if not isinstance(self.hosts, int) or not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be an integer in 1..{MAX_HOSTS}, got {self.hosts!r}")
        self.link_gbps = _positive_rate(self.link_gbps)
        if not isinstance(self.subnet_index, int) or not 0 <= self.subnet_index <= 255:
            raise ValueError(f"subnet_index must be in 0..255, got {self.subnet_index!r}")

    @property
    def subnet(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet_index}.0/24"

    @property
    def bridge(self) -> str:
        return f"{self.name}br"

    @property
    def bridge_addr(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet_index}.254"

    def namespace(self, i: int) -> str:
        return f"{self.name}h{i}"

    def veth(self, i: int) -> str:
        return f"{self.name}v{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET_BASE}.{self.subnet_index}.{i + 1}"

    @property
    def namespaces(self) -> List[str]:
        return [self.namespace(i) for i in range(self.hosts)]

    @property
    def addrs(self) -> List[str]:
        return [self.addr(i) for i in range(self.hosts)]

    @property
    def rate(self) -> str:
        """tc rate of each host's egress, in kbit (exact for fractional Gbit/s)."""
        return f"{int(round(self.link_gbps * 1e6))}kbit"

    @property
    def burst_bytes(self) -> int:
        """tbf bucket: 64 KiB at 1 Gbit/s (measured 0.96 Gbit/s TCP), 0.5 ms worth of bytes above."""
        return max(64 * 1024, int(self.link_gbps * 1e9 / 8 * 0.0005))

    @property
    def state_dir(self) -> str:
        return os.path.join(STATE_DIR, self.name)

    @property
    def state_file(self) -> str:
        return os.path.join(STATE_DIR, f"{self.name}.json")

    @property
    def agent(self) -> str:
        return os.path.join(self.state_dir, "agent.sh")

    @property
    def hostfile(self) -> str:
        return os.path.join(self.state_dir, "hostfile")


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"bed name {name!r}: use 1-10 lowercase letters/digits starting with a letter "
                         "(it prefixes interface names, which Linux limits to 15 characters)")
    return name


def setup_commands(spec: BedSpec) -> List[Tuple[str, str, List[str]]]:
    """(kind, object, argv) to run in order; kind/object name what the step creates (None: nothing new)."""
    br = spec.bridge
    steps: List[Tuple[str, str, List[str]]] = [
        ("link", br, ["ip", "link", "add", br, "type", "bridge"]),
        ("", br, ["ip", "addr", "add", f"{spec.bridge_addr}/24", "dev", br]),
        ("", br, ["ip", "link", "set", br, "up"]),
    ]
    for i in range(spec.hosts):
        ns, veth = spec.namespace(i), spec.veth(i)
        steps += [
            ("netns", ns, ["ip", "netns", "add", ns]),
            ("", ns, ["ip", "-n", ns, "link", "set", "lo", "up"]),
            ("link", veth, ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns]),
            ("", veth, ["ip", "link", "set", veth, "master", br, "up"]),
            ("", ns, ["ip", "-n", ns, "addr", "add", f"{spec.addr(i)}/24", "dev", "eth0"]),
            ("", ns, ["ip", "-n", ns, "link", "set", "eth0", "up"]),
            ("", ns, ["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", spec.rate,
                      "burst", str(spec.burst_bytes), "latency", "50ms"]),
        ]
    return steps


def teardown_commands(created: Sequence[Sequence[str]]) -> List[List[str]]:
    """Undo exactly what was created, newest first: root-side veths, namespaces, then the bridge."""
    cmds = []
    for kind, name in reversed([tuple(c) for c in created]):
        if kind == "link":
            cmds.append(["ip", "link", "del", name])
        elif kind == "netns":
            cmds.append(["ip", "netns", "del", name])
    return cmds


def agent_script(spec: BedSpec) -> str:
    """The ssh stand-in: `agent [ssh options] HOST COMMAND...` runs COMMAND in HOST's namespace.

    HOST is a host's name (= its namespace) or address. The command runs under
    `bash -c` like a remote login shell would run it, with the host's name as
    hostname in a private UTS namespace (Open MPI tells hosts apart by name).
    """
    cases = "\n".join(f"    {ns}|{addr}) ns={ns} ;;" for ns, addr in zip(spec.namespaces, spec.addrs))
    return f"""#!/bin/bash
# pycomm-testbed agent for bed '{spec.name}' (generated; replaces ssh for mpirun/mpiexec)
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;   # ssh options that take a value
    -[bcDEeFIiJLlmOoPpQRSWw]*) shift ;;    # ... value attached
    -*) shift ;;                             # flags (-x, -T, -q, -n, ...)
    *) break ;;
  esac
done
host="$1"; shift || true
case "$host" in
{cases}
    *) echo "pycomm-testbed agent: host '$host' is not part of bed {spec.name}" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts bash -c "hostname $ns && $*"
"""


def hostfile_text(spec: BedSpec, ranks_per_host: int) -> str:
    return "".join(f"{ns} slots={ranks_per_host}\n" for ns in spec.namespaces)


def job_env(env: Optional[Mapping[str, str]], spec: BedSpec, np: int, cores: Optional[int] = None) -> Dict[str, str]:
    """The job's environment: topology from MPI (no virtual nodes), one thread per rank by default."""
    out = dict(os.environ if env is None else env)
    out.pop("PYCOMM_RANKS_PER_NODE", None)
    cores = cpu_count() if cores is None else cores
    out.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, np))))
    out[ENV_MARKER] = spec.name
    out["PYTHONUNBUFFERED"] = "1"
    return out


def mpi_command(spec: BedSpec, np: int, argv: Sequence[str], *, ranks_per_host: int, launcher: str, flavour: str,
                env: Mapping[str, str], is_root: Optional[bool] = None, cores: Optional[int] = None,
                extra: Sequence[str] = ()) -> Tuple[List[str], Dict[str, str]]:
    """(launcher command, extra environment for the launcher) running `argv` on `np` ranks across the bed."""
    check_layout(spec.hosts, np, ranks_per_host)
    cores = cpu_count() if cores is None else cores
    launch_env: Dict[str, str] = {}
    if flavour == "openmpi":
        flags = ["--map-by", f"ppr:{ranks_per_host}:node", "--bind-to", "none"]
        if ranks_per_host > cores:
            flags.append("--oversubscribe")
        flags += [
            "--prtemca", "plm_ssh_agent", spec.agent,
            "--prtemca", "oob_tcp_if_include", spec.subnet,
            "--mca", "pml", "ob1",
            "--mca", "osc", "^ucx",  # UCX finds no device in a namespace (noise) and must not bypass the link
            "--mca", "btl", "tcp,sm,self",
            "--mca", "btl_tcp_if_include", spec.subnet,
            "--mca", "btl_tcp_links", "2",
            "--mca", "mpi_yield_when_idle", "1",
        ]
        cmd = build_command(np, argv, launcher=launcher, flavour=flavour, hostfile=spec.hostfile, env=env,
                            extra=[*flags, *extra], is_root=is_root, cores=cores)
    elif flavour == "mpich":
        hosts = ",".join(spec.addrs[: -(-np // ranks_per_host)])
        flags = ["-launcher", "ssh", "-launcher-exec", spec.agent, "-localhost", spec.bridge_addr,
                 "-hosts", hosts, "-ppn", str(ranks_per_host)]
        # UCX and libfabric would otherwise find shared memory between the namespaces.
        launch_env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "FI_PROVIDER": "tcp",
                      "FI_TCP_IFACE": "eth0"}
        genv = [x for k, v in launch_env.items() for x in ("-genv", k, v)]
        cmd = build_command(np, argv, launcher=launcher, flavour=flavour, hostfile=None, env=env,
                            extra=[*genv, *flags, *extra], is_root=is_root, cores=cores)
    else:
        raise ValueError(f"unknown MPI flavour {flavour!r}; expected openmpi or mpich")
    return cmd, launch_env


def check_layout(hosts: int, np: int, ranks_per_host: int) -> None:
    if not isinstance(np, int) or np < 1:
        raise ValueError(f"-np must be a positive integer, got {np!r}")
    if not isinstance(ranks_per_host, int) or ranks_per_host < 1:
        raise ValueError(f"--ranks-per-host must be a positive integer, got {ranks_per_host!r}")
    if np > hosts * ranks_per_host:
        raise ValueError(f"-np {np} does not fit on {hosts} hosts x {ranks_per_host} ranks per host; "
                         f"raise --ranks-per-host to {-(-np // hosts)} or --hosts")


def parse_qdisc_bytes(text: str) -> int:
    """Bytes sent by the root qdisc in `tc -s qdisc show dev eth0` output."""
    m = re.search(r"qdisc (\S+) \S+ root.*?\n\s*Sent (\d+) bytes", text, re.S)
    if not m:
        raise TestbedError(f"cannot read the byte counter from tc output:\n{text}")
    return int(m.group(2))


def parse_shape(text: str) -> Tuple[int, int]:
    """'2x2' -> (hosts, ranks per host)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"testbed shape {text!r}: expected HOSTSxRANKS_PER_HOST, e.g. 2x2")
    return int(m.group(1)), int(m.group(2))


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

    @property
    def host_names(self) -> List[str]:
        return self._spec().namespaces

    def run(self, np: Optional[int], argv: Sequence[str], ranks_per_host: Optional[int] = None,
            env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None, capture: bool = False,
            **kw) -> subprocess.CompletedProcess:
        """Run `argv` on `np` ranks across the hosts; see run_job."""
        return run_job(self._spec(), np, argv, ranks_per_host=ranks_per_host, env=env, timeout=timeout,
                       capture=capture, **kw)

    def link_bytes(self) -> Dict[str, int]:
        """Bytes each host has sent over its shaped link so far (tbf qdisc counter), by host name."""
        return link_bytes(self._spec())


def relaunch(shape: str, link_gbps: float, argv: Optional[Sequence[str]] = None,
             drop: Sequence[str] = ("--testbed",), env: Optional[Mapping[str, str]] = None) -> int:
    """Re-run this program (or `argv`) inside a fresh bed of shape 'HOSTSxRANKS' and return its exit code.

    For benchmarks with a ``--testbed 2x2 --link-gbps 1`` option::

        if args.testbed and not os.environ.get("PYCOMM_TESTBED"):
            sys.exit(pycomm.testbed.relaunch(args.testbed, args.link_gbps))

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
