"""Per-rank pytest setup for tests run under mpirun.

pycomm is initialized once per process. If any test fails, this rank leaves
with os._exit right after the session, skipping interpreter shutdown (which
would wait for collectives that the other ranks will never join); mpirun
then tears the job down, so a failure fails the run instead of hanging it.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pycomm  # noqa: E402


def pytest_configure(config):
    pycomm.init()
    if pycomm.rank() != 0:  # one rank reports; the others speak only when they fail
        config.option.verbose = -1


def pytest_sessionfinish(session, exitstatus):
    session.config._pycomm_exitstatus = int(exitstatus)


def pytest_unconfigure(config):
    # After the failure report has been printed.
    status = getattr(config, "_pycomm_exitstatus", 0)
    if status not in (0, 5):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


@pytest.fixture
def comm():
    """mpi4py's COMM_WORLD, for reference results computed independently of pycomm."""
    from mpi4py import MPI

    return MPI.COMM_WORLD
