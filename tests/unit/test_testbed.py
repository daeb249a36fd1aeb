"""pycomm-testbed's pure logic: names, commands, launcher flags, parsing. Needs no root and changes nothing."""
import os
import stat
import subprocess
import sys

import pytest

from pycomm.tools import testbed
from pycomm.tools.testbed import BedSpec
from pycomm.tools.testbed.cli import _drop_options as drop_options

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spec(**kw):
    args = dict(name="tb", hosts=2, link_gbps=1.0, subnet_index=7)
    args.update(kw)
    return BedSpec(**args)


def test_names_and_addresses_derive_from_the_bed():
    s = spec(hosts=3)
    assert s.namespaces == ["tbh0", "tbh1", "tbh2"]
    assert s.addrs == ["10.77.7.1", "10.77.7.2", "10.77.7.3"]
    assert s.bridge == "tbbr" and s.bridge_addr == "10.77.7.254" and s.subnet == "10.77.7.0/24"
    assert s.rate == "1000000kbit" and s.burst_bytes == 64 * 1024
    assert spec(link_gbps=0.5).rate == "500000kbit"
    assert spec(link_gbps=100).burst_bytes == int(100e9 / 8 * 0.0005)


@pytest.mark.parametrize("name", ["", "Upper", "1abc", "a-b", "abcdefghijk", "a b"])
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError, match="15 characters"):
        spec(name=name)


def test_longest_name_fits_interface_limit():
    s = spec(name="abcdefghij", hosts=testbed.MAX_HOSTS)
    for ifname in [s.bridge, s.veth(testbed.MAX_HOSTS - 1)]:
        assert len(ifname) <= 15


@pytest.mark.parametrize("kw,msg", [({"hosts": 0}, "hosts must be"), ({"hosts": 17}, "hosts must be"),
                                     ({"link_gbps": 0}, "link_gbps must be"),
                                     ({"link_gbps": "fast"}, "link_gbps must be a number"),
                                     ({"subnet_index": 256}, "subnet_index")])
def test_bad_specs_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        spec(**kw)


def test_setup_touches_only_objects_of_the_bed():
    s = spec()
    steps = testbed.setup_commands(s)
    created = [(kind, obj) for kind, obj, _ in steps if kind]
    assert created == [("link", "tbbr"), ("netns", "tbh0"), ("link", "tbv0"), ("netns", "tbh1"), ("link", "tbv1")]
    ours = {"tbbr", "tbh0", "tbh1", "tbv0", "tbv1"}
    for _, obj, argv in steps:
        assert obj in ours
        if "addr" in argv:  # addresses: the bridge's, and the hosts' inside their namespaces only
            dev = argv[argv.index("dev") + 1]
            assert dev == "tbbr" or (argv[1] == "-n" and argv[2] in ("tbh0", "tbh1") and dev == "eth0"), argv
            assert argv[argv.index("add") + 1].startswith("10.77.7.")
    shaping = [argv for _, _, argv in steps if argv[0] == "tc"]
    assert len(shaping) == 2
    for argv in shaping:
        assert argv[1] == "-n" and argv[argv.index("dev") + 1] == "eth0"
        assert "tbf" in argv and argv[argv.index("rate") + 1] == "1000000kbit"


def test_teardown_undoes_exactly_what_was_created_newest_first():
    created = [["link", "tbbr"], ["netns", "tbh0"], ["link", "tbv0"]]
    assert testbed.teardown_commands(created) == [["ip", "link", "del", "tbv0"], ["ip", "netns", "del", "tbh0"],
                                                  ["ip", "link", "del", "tbbr"]]
    assert testbed.teardown_commands([]) == []


def test_openmpi_command_has_the_multihost_flags():
    s = spec()
    cmd, extra_env = testbed.mpi_command(s, 4, ["python", "x.py"], ranks_per_host=2, launcher="mpirun",
                                         flavour="openmpi", env={"PYCOMM_A": "1"}, is_root=True, cores=2)
    assert extra_env == {}
    assert cmd[:3] == ["mpirun", "-np", "4"] and cmd[-2:] == ["python", "x.py"]
    text = " ".join(cmd)
    for flags in ("--allow-run-as-root", f"--hostfile {s.hostfile}", "--map-by ppr:2:node",
                  f"--prtemca plm_ssh_agent {s.agent}", "--mca pml ob1", "--mca osc ^ucx", "--mca btl tcp,sm,self",
                  "--mca btl_tcp_if_include 10.77.7.0/24", "--prtemca oob_tcp_if_include 10.77.7.0/24",
                  "--mca mpi_yield_when_idle 1", "--mca btl_tcp_links 2", "-x PYCOMM_A=1"):
        assert flags in text, flags
    assert "--oversubscribe" not in cmd
    assert cmd.count("--bind-to") == 1  # Open MPI refuses an option given twice


def test_openmpi_oversubscribes_only_above_the_core_count():
    cmd, _ = testbed.mpi_command(spec(), 8, ["a"], ranks_per_host=4, launcher="mpirun", flavour="openmpi",
                                 env={}, is_root=False, cores=2)
    assert "--oversubscribe" in cmd and "--allow-run-as-root" not in cmd


def test_mpich_command_forces_tcp_over_the_bed():
    s = spec(hosts=3)
    cmd, extra_env = testbed.mpi_command(s, 4, ["a"], ranks_per_host=2, launcher="mpiexec", flavour="mpich",
                                         env={}, is_root=True, cores=2)
    assert extra_env["UCX_TLS"] == "tcp,self" and extra_env["UCX_NET_DEVICES"] == "eth0"
    text = " ".join(cmd)
    assert f"-launcher ssh -launcher-exec {s.agent}" in text
    assert "-localhost 10.77.7.254" in text and "-ppn 2" in text
    assert cmd[cmd.index("-hosts") + 1] == "10.77.7.1,10.77.7.2"  # only the hosts that get ranks
    assert "-genv UCX_TLS tcp,self" in text
    assert "--allow-run-as-root" not in cmd


def test_unknown_flavour():
    with pytest.raises(ValueError, match="unknown MPI flavour"):
        testbed.mpi_command(spec(), 2, ["a"], ranks_per_host=1, launcher="x", flavour="lam", env={})


@pytest.mark.parametrize("np,rph,msg", [(0, 1, "-np must be"), (5, 2, "does not fit"), (2, 0, "--ranks-per-host")])
def test_layout_checks(np, rph, msg):
    with pytest.raises(ValueError, match=msg):
        testbed.check_layout(2, np, rph)


def test_job_env_takes_topology_from_mpi():
    env = testbed.job_env({"PYCOMM_RANKS_PER_NODE": "2", "X": "1"}, spec(), np=4, cores=2)
    assert "PYCOMM_RANKS_PER_NODE" not in env
    assert env["X"] == "1" and env["OMP_NUM_THREADS"] == "1" and env[testbed.ENV_MARKER] == "tb"
    assert testbed.job_env({"OMP_NUM_THREADS": "3"}, spec(), np=4, cores=2)["OMP_NUM_THREADS"] == "3"


def test_hostfile_lists_host_names_with_slots():
    assert testbed.hostfile_text(spec(), 2) == "tbh0 slots=2\ntbh1 slots=2\n"


TC_OUTPUT = """qdisc tbf 8001: root refcnt 3 rate 1Gbit burst 65500b lat 50ms
 Sent 20693 bytes 107 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""


def test_qdisc_counter_parsing():
    assert testbed.parse_qdisc_bytes(TC_OUTPUT) == 20693
    with pytest.raises(testbed.TestbedError, match="byte counter"):
        testbed.parse_qdisc_bytes("qdisc noqueue 0: root refcnt 2\n")


def test_shape_and_option_dropping():
    assert testbed.parse_shape("2x2") == (2, 2) and testbed.parse_shape("3X1") == (3, 1)
    for bad in ("2", "0x2", "axb", ""):
        with pytest.raises(ValueError, match="HOSTSxRANKS_PER_HOST"):
            testbed.parse_shape(bad)
    argv = ["bench.py", "--testbed", "2x2", "--size", "64M", "--link-gbps=1", "--json", "o.json"]
    assert drop_options(argv, ("--testbed", "--link-gbps")) == ["bench.py", "--size", "64M", "--json",
                                                                         "o.json"]


def test_agent_drops_ssh_options_and_enters_the_host_namespace(tmp_path):
    s = spec()
    agent = tmp_path / "agent.sh"
    agent.write_text(testbed.agent_script(s))
    agent.chmod(agent.stat().st_mode | stat.S_IXUSR)
    stub = tmp_path / "ip"  # stands in for `ip`: prints what it would run
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    out = subprocess.run([str(agent), "-x", "-o", "StrictHostKeyChecking=no", "-p", "22", "10.77.7.2",
                          "prted", "--x", "a b"], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    args = out.stdout.splitlines()
    assert args[:6] == ["netns", "exec", "tbh1", "unshare", "--uts", "bash"]
    assert args[6] == "-c" and args[7] == "hostname tbh1 && prted --x a b"
    out = subprocess.run([str(agent), "-x", "otherhost", "true"], capture_output=True, text=True, env=env,
                         timeout=30)
    assert out.returncode == 255 and "not part of bed tb" in out.stderr


def test_not_root_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, why = testbed.available()
    assert not ok and "needs root" in why
    with pytest.raises(testbed.TestbedError, match="needs root"):
        testbed.create("tbx")


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pycomm.tools.testbed", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


def test_cli_dry_run_prints_the_launch_command():
    from pycomm.tools.launcher import find_launcher, mpi_flavour

    out = _cli("run", "--dry-run", "--name", "tbdry", "-np", "4", "--", "python", "x.py")
    assert out.returncode == 0, out.stderr
    assert "x.py" in out.stdout
    flavour = mpi_flavour(find_launcher())  # the environment's MPI decides the flags
    if flavour == "openmpi":
        assert "--map-by ppr:2:node" in out.stdout and "plm_ssh_agent" in out.stdout, out.stdout
    else:
        assert flavour == "mpich", flavour
        assert "-ppn 2" in out.stdout and "-launcher ssh -launcher-exec" in out.stdout, out.stdout
        assert "FI_PROVIDER=tcp" in out.stdout and "--map-by" not in out.stdout, out.stdout


def test_cli_errors_name_the_problem():
    out = _cli("run", "--dry-run", "-np", "5", "--ranks-per-host", "2", "--", "a")
    assert out.returncode == 2 and "does not fit on 2 hosts" in out.stderr
    out = _cli("run", "--dry-run", "-np", "2")
    assert out.returncode == 2 and "no command given" in out.stderr
    out = _cli("up", "--name", "Bad-Name")
    assert out.returncode == 2 and "bed name" in out.stderr
