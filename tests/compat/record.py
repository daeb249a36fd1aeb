"""pytest plugin: each rank appends one JSON line per finished test to $PYCOMM_COMPAT_OUT/<rank>.jsonl.

Lines are written (and flushed) as tests finish, so when a job dies midway
bench/compat.py still knows which tests finished and which one was running.
"""
import json
import os

_RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
_FILE = None


def _out():
    global _FILE
    if _FILE is None:
        _FILE = open(os.path.join(os.environ["PYCOMM_COMPAT_OUT"], f"{_RANK}.jsonl"), "a", buffering=1)
    return _FILE


def pytest_runtest_logstart(nodeid, location):
    _out().write(json.dumps({"test": nodeid.split("::")[-1], "event": "start"}) + "\n")


def pytest_runtest_setup(item):
    # Every rank starts each test together (an MPI barrier of the harness, outside the code under test),
    # as when Horovod's suite runs each test file under its own launcher: a test that fails on one rank
    # then cannot shift the next tests of the others.
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1]
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = report.outcome
        msg = ""
        if report.failed:
            msg = str(report.longrepr.reprcrash.message if hasattr(report.longrepr, "reprcrash") and
                      report.longrepr.reprcrash else report.longrepr)[:400]
        elif report.skipped:
            msg = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)[:200]
        _out().write(json.dumps({"test": name, "event": outcome, "msg": msg}) + "\n")
