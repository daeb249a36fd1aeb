"""pycomm-run --elastic: the launcher flags of elastic mode (docs/elastic.md)."""
import subprocess
import sys

import pytest

from pycomm.tools.launcher import find_launcher, mpi_flavour


def _dry_run(*args, launcher=None):
    cmd = [sys.executable, "-m", "pycomm.tools.launcher", "-np", "3", "--elastic", "--dry-run"]
    if launcher:
        cmd += ["--launcher", launcher]
    return subprocess.run(cmd + list(args) + ["--", "python", "train.py"], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(mpi_flavour(find_launcher()) != "openmpi", reason="this environment's MPI is not Open MPI")
def test_elastic_adds_fault_tolerance_and_sets_pycomm_elastic():
    out = _dry_run()
    assert out.returncode == 0, out.stderr
    line = out.stderr
    assert "--with-ft ulfm --mca async_mpi_finalize 1" in line, line
    assert "-x PYCOMM_ELASTIC=1" in line, line
    assert line.index("--with-ft") < line.index("train.py")


def test_elastic_is_refused_for_a_launcher_that_is_not_open_mpi(tmp_path):
    fake = tmp_path / "mpiexec.hydra"  # stands in for MPICH's launcher: mpi_flavour reads its --version
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\necho '    Version: 4.1'\n")
    fake.chmod(0o755)
    assert mpi_flavour(str(fake)) == "mpich"
    out = _dry_run(launcher=str(fake))
    assert out.returncode == 2, out
    assert "--elastic needs Open MPI's fault tolerance (mpirun --with-ft ulfm)" in out.stderr, out.stderr


@pytest.mark.skipif(mpi_flavour(find_launcher()) != "openmpi", reason="this environment's MPI is not Open MPI")
def test_min_and_max_np_reach_the_ranks_through_the_environment():
    out = _dry_run("--min-np", "2", "--max-np", "4")
    assert out.returncode == 0, out.stderr
    assert "-x PYCOMM_ELASTIC_MIN_NP=2" in out.stderr and "-x PYCOMM_ELASTIC_MAX_NP=4" in out.stderr, out.stderr


@pytest.mark.parametrize("args,why", [(["--min-np", "4"], "--min-np 4 must be between 1 and -np 3"),
                                      (["--max-np", "2"], "--max-np 2 must be at least -np 3")])
def test_min_and_max_np_must_bracket_np(args, why):
    out = _dry_run(*args)
    assert out.returncode == 2 and why in out.stderr, out.stderr


def test_min_and_max_np_need_elastic():
    out = subprocess.run([sys.executable, "-m", "pycomm.tools.launcher", "-np", "3", "--max-np", "4", "--dry-run",
                          "--", "python", "train.py"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--min-np and --max-np need --elastic" in out.stderr, out.stderr
