"""pycomm-run builds the launcher command the situation needs, and only that."""
import subprocess
import sys

from pycomm.launcher import build_command


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


def test_mpich_needs_neither_flag():
    cmd = build_command(8, ["a"], launcher="mpiexec", flavour="mpich", env={"OMP_NUM_THREADS": "3"},
                        is_root=True, cores=2, hostfile="hosts")
    assert "--allow-run-as-root" not in cmd and "--oversubscribe" not in cmd
    assert cmd[cmd.index("-f") + 1] == "hosts"
    assert ["-genv", "OMP_NUM_THREADS", "3"] == cmd[cmd.index("-genv"):cmd.index("-genv") + 3]


def test_dry_run_prints_and_does_not_run():
    out = subprocess.run([sys.executable, "-m", "pycomm.launcher", "-np", "3", "--dry-run", "--", "python", "nope.py"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "pycomm-run:" in out.stderr and "-np 3" in out.stderr and "nope.py" in out.stderr


def test_missing_command_is_an_error():
    out = subprocess.run([sys.executable, "-m", "pycomm.launcher", "-np", "2"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "no command given" in out.stderr
