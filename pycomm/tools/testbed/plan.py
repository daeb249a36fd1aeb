"""What a test bed is, and the commands that build it and launch a job on it: pure functions, no system calls."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..launcher import build_command, cpu_count

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
        flags = ["--map-by", f"ppr:{ranks_per_host}:node"]  # build_command adds --bind-to none
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
