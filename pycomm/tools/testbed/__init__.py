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
from .plan import (
    DEFAULT_NAME,
    ENV_MARKER,
    MAX_HOSTS,
    STATE_DIR,
    BedSpec,
    TestbedError,
    agent_script,
    check_layout,
    hostfile_text,
    job_env,
    mpi_command,
    parse_qdisc_bytes,
    parse_shape,
    setup_commands,
    teardown_commands,
    validate_name,
)
from .system import Testbed, available, beds, create, destroy, link_bytes, load, run_job
from .cli import main, relaunch

__all__ = [
    "DEFAULT_NAME", "ENV_MARKER", "MAX_HOSTS", "STATE_DIR", "BedSpec", "Testbed", "TestbedError", "agent_script",
    "available", "beds", "check_layout", "create", "destroy", "hostfile_text", "job_env", "link_bytes", "load",
    "main", "mpi_command", "parse_qdisc_bytes", "parse_shape", "relaunch", "run_job", "setup_commands",
    "teardown_commands", "validate_name",
]
