"""pycomm-run builds the launcher command the situation needs, and only that."""
import subprocess
import sys

import pytest

from pycomm.tools.launcher import build_command


def test_openmpi_root_oversubscribed():
    cmd = build_command(4, ["python", "x.py"], launcher="mpirun", flavour="openmpi", env={}, is_root=True, cores=2)
    assert cmd[:3] == ["mpirun", "-np", "4"]
    assert "--allow-run-as-root" in cmd
    assert "--oversubscribe" in cmd and "mpi_yield_when_idle" in cmd
    assert "OMP_NUM_THREADS=1" in cmd
    assert cmd[-2:] == ["python", "x.py"]


def test_openmpi_not_root_fits_cores():
    cmd = build_command(2, ["a"], launcher="mpirun", flavour="openmpi", env={"PYCOMM_X": "1"}, is_root=False, cores=8)
    assert "--allow-run-as-root" not in cmd and "--oversubscribe" not in cmd
    assert "OMP_NUM_THREADS=4" in cmd and "PYCOMM_X=1" in cmd


def test_one_host_skips_the_libfabric_probe_unless_the_caller_chose_btls():
    def btl_args(**kw):
        cmd = build_command(2, ["a"], launcher="mpirun", flavour="openmpi", is_root=False, cores=2, **kw)
        return [cmd[i + 1] for i, x in enumerate(cmd) if x == "btl" and cmd[i - 1] == "--mca"]

    assert btl_args(env={}) == ["^ofi"]
    assert btl_args(env={"OMPI_MCA_btl": "tcp,self"}) == []  # the environment's choice is not overridden
    assert btl_args(env={}, extra=["--mca", "btl", "tcp,self"]) == ["tcp,self"]
    assert btl_args(env={}, hosts=[("a", 1), ("b", 1)]) == []  # several hosts may need libfabric


def test_mpich_needs_neither_flag():
    cmd = build_command(8, ["a"], launcher="mpiexec", flavour="mpich", env={"OMP_NUM_THREADS": "3"},
                        is_root=True, cores=2, hostfile="hosts")
    assert "--allow-run-as-root" not in cmd and "--oversubscribe" not in cmd
    assert cmd[cmd.index("-f") + 1] == "hosts"
    assert ["-genv", "OMP_NUM_THREADS", "3"] == cmd[cmd.index("-genv"):cmd.index("-genv") + 3]


def test_dry_run_prints_and_does_not_run():
    out = subprocess.run([sys.executable, "-m", "pycomm.tools.launcher", "-np", "3", "--dry-run", "--", "python", "nope.py"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "pycomm-run:" in out.stderr and "-np 3" in out.stderr and "nope.py" in out.stderr


def test_missing_command_is_an_error():
    out = subprocess.run([sys.executable, "-m", "pycomm.tools.launcher", "-np", "2"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "no command given" in out.stderr


# ---------------------------------------------------------------- several hosts, exports, --check-build

from pycomm.tools.launcher import parse_hostfile, parse_hosts, ranks_per_host  # noqa: E402


def test_parse_hosts_and_errors():
    assert parse_hosts("node1:2,node2:2") == [("node1", 2), ("node2", 2)]
    assert parse_hosts("a,b:3") == [("a", 1), ("b", 3)]
    for bad in ("a:0", "a:x", ":2", ","):
        with pytest.raises(ValueError, match="host"):
            parse_hosts(bad)


def test_parse_hostfile_both_formats(tmp_path):
    ompi = tmp_path / "ompi"
    ompi.write_text("# cluster\nnode1 slots=4\nnode2 slots=2 max_slots=8\nnode3\n")
    assert parse_hostfile(str(ompi)) == [("node1", 4), ("node2", 2), ("node3", 1)]
    mpich = tmp_path / "mpich"
    mpich.write_text("node1:2\nnode2:2  # comment\n")
    assert parse_hostfile(str(mpich)) == [("node1", 2), ("node2", 2)]
    bad = tmp_path / "bad"
    bad.write_text("node1 slots=many\n")
    with pytest.raises(ValueError, match="bad:1: cannot read the slot count"):
        parse_hostfile(str(bad))


def test_ranks_fill_hosts_in_order():
    assert ranks_per_host(3, [("a", 2), ("b", 2)]) == {"a": 2, "b": 1}
    with pytest.raises(ValueError, match="-np 5 is more than the 4 slots"):
        ranks_per_host(5, [("a", 2), ("b", 2)])


ENV = {"PATH": "/p", "PYTHONPATH": "/pp", "LD_LIBRARY_PATH": "/l", "CUDA_VISIBLE_DEVICES": "0,1",
       "NCCL_DEBUG": "INFO", "UCX_TLS": "tcp", "OMPI_MCA_btl": "tcp,self", "PYCOMM_X": "1", "HOME": "/root",
       "MY_VAR": "7"}


def test_openmpi_hosts_export_environment():
    cmd = build_command(4, ["python", "x.py"], launcher="mpirun", flavour="openmpi", env=ENV, is_root=False, cores=8,
                        hosts=[("a", 2), ("b", 2)], export=["MY_VAR", "SET=2"])
    assert cmd[cmd.index("--host") + 1] == "a:2,b:2"
    exported = {cmd[i + 1] for i, x in enumerate(cmd) if x == "-x"}
    assert exported == {"PATH=/p", "PYTHONPATH=/pp", "LD_LIBRARY_PATH=/l", "CUDA_VISIBLE_DEVICES=0,1",
                        "NCCL_DEBUG=INFO", "UCX_TLS=tcp", "OMPI_MCA_btl=tcp,self", "PYCOMM_X=1", "MY_VAR=7",
                        "SET=2", "OMP_NUM_THREADS=4"}  # 8 cores / 2 ranks on the busiest host
    assert "HOME=/root" not in exported
    assert "--oversubscribe" not in cmd and "mpi_yield_when_idle" not in cmd
    assert ["--bind-to", "none"] == cmd[cmd.index("--bind-to"):cmd.index("--bind-to") + 2]
    assert "^ucx" not in cmd  # several hosts may use UCX


def test_hosts_with_more_slots_than_cores_yield():
    cmd = build_command(8, ["a"], launcher="mpirun", flavour="openmpi", env={}, is_root=False, cores=2,
                        hosts=[("a", 4), ("b", 4)])
    assert "--oversubscribe" not in cmd  # the slots allow it
    assert "mpi_yield_when_idle" in cmd and "OMP_NUM_THREADS=1" in cmd


def test_mpich_hosts_and_hostfile(tmp_path):
    cmd = build_command(2, ["a"], launcher="mpiexec", flavour="mpich", env=ENV, is_root=True, cores=2,
                        hosts=[("a", 1), ("b", 1)])
    assert cmd[cmd.index("-hosts") + 1] == "a:1,b:1"
    assert ["-genv", "UCX_TLS", "tcp"] == cmd[cmd.index("UCX_TLS") - 1:cmd.index("UCX_TLS") + 2]
    hostfile = tmp_path / "h"
    hostfile.write_text("a:1\nb:1\n")
    cmd = build_command(2, ["a"], launcher="mpiexec", flavour="mpich", env=ENV, is_root=True, cores=2,
                        hostfile=str(hostfile))
    assert cmd[cmd.index("-f") + 1] == str(hostfile) and "-hosts" not in cmd and "PATH" in cmd


def test_one_host_passes_only_what_was_asked():
    cmd = build_command(2, ["a"], launcher="mpirun", flavour="openmpi", env=ENV, is_root=False, cores=2,
                        export=["MY_VAR"])
    exported = {cmd[i + 1] for i, x in enumerate(cmd) if x == "-x"}
    assert exported == {"MY_VAR=7", "PYCOMM_X=1", "OMP_NUM_THREADS=1"}


def test_export_of_an_unset_variable_is_an_error():
    with pytest.raises(ValueError, match="-x NOPE: NOPE is not set"):
        build_command(2, ["a"], launcher="mpirun", flavour="openmpi", env={}, is_root=False, cores=2,
                      export=["NOPE"])


def test_cli_hosts_dry_run_and_slot_error():
    run = [sys.executable, "-m", "pycomm.tools.launcher"]
    out = subprocess.run(run + ["-np", "4", "-H", "a:2,b:2", "--dry-run", "python", "x.py"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "a:2,b:2" in out.stderr
    out = subprocess.run(run + ["-np", "5", "-H", "a:2,b:2", "python", "x.py"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "-np 5 is more than the 4 slots" in out.stderr


def test_check_build_reports_the_build():
    out = subprocess.run([sys.executable, "-m", "pycomm.tools.launcher", "--check-build", "-np", "4", "-H", "a:2,b:2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
    for key in ("pycomm", "torch", "CUDA", "CPU", "MPI", "mpi4py", "launcher", "job", "tune"):
        assert key in rows, out.stdout
    assert "4 ranks, 2 node(s) x 2" in out.stdout
    assert "CUDA-aware MPI" in out.stdout and "tune table" in out.stdout
