"""Runs every tests/parallel/test_*.py file under mpirun at 1, 2, 3 and 4 ranks.

Each (file, ranks) pair is one test here; inside it every rank runs the
file's tests and asserts its own results against independent references.
"""
import glob
import os

import pytest

from mpi_launch import run_pytest_under_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = sorted(os.path.relpath(p, os.path.dirname(HERE)) for p in glob.glob(os.path.join(HERE, "parallel", "test_*.py")))
# PYCOMM_TEST_FILES=test_allreduce.py,test_ps.py runs those files only (.ci/mpich.sh: the engine's files).
_chosen = [f for f in os.environ.get("PYCOMM_TEST_FILES", "").split(",") if f]
_unknown = sorted(set(_chosen) - {os.path.basename(f) for f in FILES})
if _unknown:
    raise ValueError(f"PYCOMM_TEST_FILES names files that tests/parallel does not have: {_unknown}")
if _chosen:
    FILES = [f for f in FILES if os.path.basename(f) in _chosen]
WORLD_SIZES = [int(n) for n in os.environ.get("PYCOMM_TEST_WORLD_SIZES", "1,2,3,4").split(",")]


@pytest.mark.mpi
@pytest.mark.parametrize("np", WORLD_SIZES)
@pytest.mark.parametrize("path", FILES)
def test_under_mpirun(path, np):
    rc, out = run_pytest_under_mpi(np, path)
    if rc != 0:
        pytest.fail(f"{path} failed at {np} ranks (exit {rc}):\n{out[-12000:]}", pytrace=False)


SHAPES = [(4, 2), (4, 1), (3, 2), (2, 1)]


@pytest.mark.mpi
@pytest.mark.parametrize("np,ranks_per_node,file", [
    (np_, per, f) for f in ("test_hierarchical.py", "test_device_compression.py") for np_, per in SHAPES] + [
    # The peer path across nodes (2x2) and refused on nodes of unequal sizes (2+1).
    (4, 2, "test_peer_allreduce.py"), (3, 2, "test_peer_allreduce.py")])
def test_virtual_nodes(file, np, ranks_per_node):
    """Multi-node code paths on one machine: 4 ranks as 2x2 and 4x1, 3 ranks as 2+1, 2 ranks as 2x1."""
    if np not in WORLD_SIZES:
        pytest.skip(f"world size {np} not selected by PYCOMM_TEST_WORLD_SIZES")
    path = os.path.join("tests", "parallel", file)
    rc, out = run_pytest_under_mpi(np, path, env={"PYCOMM_RANKS_PER_NODE": str(ranks_per_node)})
    if rc != 0:
        pytest.fail(f"{path} failed at {np} ranks, {ranks_per_node} per node (exit {rc}):\n{out[-12000:]}",
                    pytrace=False)
