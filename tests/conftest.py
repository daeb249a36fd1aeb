import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PARALLEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel")


def pytest_ignore_collect(collection_path, config):
    # tests/parallel runs under mpirun, driven by tests/test_parallel.py
    # (which sets PYCOMM_UNDER_MPIRUN for the ranks); never in this process.
    if str(collection_path).startswith(PARALLEL) and not os.environ.get("PYCOMM_UNDER_MPIRUN"):
        return True
    return None
