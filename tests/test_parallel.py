"""Runs every tests/parallel/test_*.py file under mpirun at 1, 2, 3 and 4 ranks.

The files run in groups, one mpirun job per (group, ranks) pair, which is one test here; inside it every
rank runs the group's files in one pytest session and asserts its own results against independent
references. A job's start (mpirun, then torch, pycomm and pytest imported on every rank) costs 2.5 s at
1 rank to 5.5 s at 4 on the 2-core machine, more than most files' tests: one job per file spent about
600 of its 870 s starting (docs/testing.md).

Each group is a layer of pycomm; so the files of a group share one process, and leave behind no state a
later file could trip on (torch.distributed default groups are destroyed, tests/parallel/torch_worlds.py).
A file whose tests count the engine's process-wide allocations from a fresh start runs alone.
"""
import glob
import os

import pytest

from mpi_launch import run_pytest_under_mpi

HERE = os.path.dirname(os.path.abspath(__file__))

GROUPS = {
    "engine": ["test_allreduce.py", "test_broadcast_allgather.py", "test_reduce_scatter_alltoall.py",
               "test_hierarchical.py", "test_fusion.py", "test_groups.py", "test_disagreement.py",
               "test_same_answer.py", "test_pair_by_name.py", "test_join_timeline.py", "test_contention.py",
               "test_dtypes.py"],
    "devices": ["test_device_compression.py", "test_device_stream.py", "test_peer_allreduce.py"],
    # test_device_direct_working_memory_is_cached counts the working-memory cache's allocations from the
    # process's first ring: alone.
    "staging": ["test_staging.py"],
    "compression": ["test_compression.py", "test_sparse_compression.py", "test_powersgd.py",
                    "test_compression_training.py"],
    "torch": ["test_c10d.py", "test_c10d_ddp.py", "test_ddp_hooks.py", "test_ddp_hooks_sparse_lowrank.py"],
    "horovod": ["test_horovod_api.py", "test_horovod_optimizer.py", "test_horovod_scripts.py"],
    "optimizers": ["test_optimizer.py", "test_optim_distopt.py", "test_optim_lars_lamb.py",
                   "test_optim_mixed_precision.py", "test_optim_onebit.py"],
    "algorithms": ["test_algorithms_sync.py", "test_algorithms_async.py", "test_backup_sgd.py", "test_ec_dnn.py",
                   "test_ps.py"],
}

_present = {os.path.basename(p) for p in glob.glob(os.path.join(HERE, "parallel", "test_*.py"))}
_grouped = [f for files in GROUPS.values() for f in files]
if sorted(_grouped) != sorted(_present):
    raise ValueError(f"tests/test_parallel.py GROUPS must name every tests/parallel file once: not grouped "
                     f"{sorted(_present - set(_grouped))}, not present {sorted(set(_grouped) - _present)}, "
                     f"named twice {sorted({f for f in _grouped if _grouped.count(f) > 1})}")

# PYCOMM_TEST_FILES=test_allreduce.py,test_ps.py runs those files only (.ci/mpich.sh: the engine's files).
_chosen = [f for f in os.environ.get("PYCOMM_TEST_FILES", "").split(",") if f]
_unknown = sorted(set(_chosen) - _present)
if _unknown:
    raise ValueError(f"PYCOMM_TEST_FILES names files that tests/parallel does not have: {_unknown}")
if _chosen:
    GROUPS = {g: [f for f in files if f in _chosen] for g, files in GROUPS.items()}
    GROUPS = {g: files for g, files in GROUPS.items() if files}
WORLD_SIZES = [int(n) for n in os.environ.get("PYCOMM_TEST_WORLD_SIZES", "1,2,3,4").split(",")]


def _paths(files):
    return [os.path.join("tests", "parallel", f) for f in files]


def _run(np, files, env=None, what=""):
    rc, out = run_pytest_under_mpi(np, _paths(files), env=env)
    if rc != 0:
        pytest.fail(f"{', '.join(files)} failed at {np} ranks{what} (exit {rc}):\n{out[-12000:]}", pytrace=False)


@pytest.mark.mpi
@pytest.mark.parametrize("np", WORLD_SIZES)
@pytest.mark.parametrize("group", list(GROUPS))
def test_under_mpirun(group, np):
    _run(np, GROUPS[group])


# Multi-node code paths on one machine: 4 ranks as 2x2 and 4x1, 3 ranks as 2+1, 2 ranks as 2x1. The peer
# path runs across nodes (2x2) and is refused on nodes of unequal sizes (2+1).
VIRTUAL_NODES = {(4, 2): ["test_hierarchical.py", "test_device_compression.py", "test_peer_allreduce.py"],
                 (4, 1): ["test_hierarchical.py", "test_device_compression.py"],
                 (3, 2): ["test_hierarchical.py", "test_device_compression.py", "test_peer_allreduce.py"],
                 (2, 1): ["test_hierarchical.py", "test_device_compression.py"]}


@pytest.mark.mpi
@pytest.mark.parametrize("np,ranks_per_node", list(VIRTUAL_NODES))
def test_virtual_nodes(np, ranks_per_node):
    if np not in WORLD_SIZES:
        pytest.skip(f"world size {np} not selected by PYCOMM_TEST_WORLD_SIZES")
    _run(np, VIRTUAL_NODES[np, ranks_per_node], env={"PYCOMM_RANKS_PER_NODE": str(ranks_per_node)}, what=f", {ranks_per_node} per node")
