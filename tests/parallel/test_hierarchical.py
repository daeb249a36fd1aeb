"""Hierarchical and shared-memory allreduce on real and virtual nodes.

tests/test_parallel.py also runs this file with PYCOMM_RANKS_PER_NODE=1 and 2,
so 4 ranks run as 1x4, 2x2 and 4x1 nodes and 3 ranks as nodes of 2 and 1.
"""
import os

import numpy as np
import pytest
import torch

import pycomm
from refdata import assert_close, rank_data

COUNTS = [1, 2, 3, 5, 1001, 65537, 250_003]
HIER = ["hierarchical", "hierarchical_master"]


def expected_topology(size, rank):
    per = int(os.environ.get("PYCOMM_RANKS_PER_NODE", "0")) or size  # one machine: one real node
    nodes = -(-size // per)
    return dict(num_nodes=nodes, node_rank=rank // per, local_rank=rank % per,
                local_size=min(per, size - (rank // per) * per))


def test_topology_follows_virtual_nodes(comm):
    topo = pycomm.topology()
    exp = expected_topology(topo.size, topo.rank)
    assert (topo.num_nodes, topo.node_rank, topo.local_rank, topo.local_size) == \
        (exp["num_nodes"], exp["node_rank"], exp["local_rank"], exp["local_size"])
    assert pycomm.local_comm().size == topo.local_size
    assert pycomm.cross_comm().size == sum(1 for r in range(topo.size)
                                           if expected_topology(topo.size, r)["local_rank"] == topo.local_rank)


@pytest.mark.parametrize("algorithm", HIER + ["shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_allreduce_against_reference(algorithm, dtype, comm):
    topo = pycomm.topology()
    if algorithm == "shm" and topo.num_nodes > 1:
        with pytest.raises(pycomm.CommError, match="reduces within one node"):
            pycomm.allreduce(torch.ones(10), algorithm="shm")
        return
    if algorithm in HIER and not topo.homogeneous:
        with pytest.raises(pycomm.CommError, match="same number of ranks on every node"):
            pycomm.allreduce(torch.ones(10), algorithm=algorithm)
        return
    for count in COUNTS:
        x = rank_data(topo.rank, count, dtype, seed=31)
        y = pycomm.allreduce(x.clone(), algorithm=algorithm)
        assert_close(y, "sum", topo.size, dtype, seed=31, what=f"{algorithm} {dtype} [{count}]")
        copies = comm.allgather(y.reshape(-1).view(torch.uint8).numpy().tobytes())
        assert all(c == copies[0] for c in copies), f"{algorithm}: ranks hold different results"


@pytest.mark.parametrize("algorithm", HIER + ["shm"])
def test_ops_and_growing_window(algorithm, comm):
    topo = pycomm.topology()
    if (algorithm == "shm" and topo.num_nodes > 1) or (algorithm in HIER and not topo.homogeneous):
        pytest.skip("not available on this topology (checked above)")
    from mpi4py import MPI

    for count in (10, 3_000_001, 17):  # the window grows, then serves a small call
        x = rank_data(topo.rank, count, torch.float64, seed=32)
        for op, mpi_op in (("max", MPI.MAX), ("min", MPI.MIN), ("sum", MPI.SUM)):
            ref = np.empty(count)
            comm.Allreduce(x.numpy(), ref, op=mpi_op)
            y = pycomm.allreduce(x.clone(), op=op, algorithm=algorithm)
            np.testing.assert_allclose(y.numpy(), ref, rtol=1e-13, atol=1e-10)
        y = pycomm.allreduce(x.clone(), op="avg", algorithm=algorithm)
        np.testing.assert_allclose(y.numpy(), ref / topo.size, rtol=1e-13, atol=1e-10)


def test_auto_picks_by_size_and_topology():
    topo = pycomm.topology()
    # One node of several ranks: shm at every size (measured faster than MPI's
    # Allreduce from 4 KiB, bench/auto_regret.py). Otherwise MPI's own allreduce
    # below auto_ring_min_bytes, and from that size on by topology.
    edge = pycomm.get_options()["auto_ring_min_bytes"]
    big = pycomm.resolve_algorithm("auto", 64 << 20)
    assert pycomm.resolve_algorithm("auto", edge) == big
    if topo.num_nodes == 1 and topo.size > 1:
        assert big == "shm"
        assert pycomm.resolve_algorithm("auto", 100) == pycomm.resolve_algorithm("auto", edge - 1) == "shm"
    else:
        assert pycomm.resolve_algorithm("auto", 100) == "mpi"
        assert pycomm.resolve_algorithm("auto", edge - 1) == "mpi"
        assert big == ("hierarchical" if topo.num_nodes > 1 and topo.homogeneous and topo.local_size > 1 else "ring")
    assert pycomm.resolve_algorithm("ring", 100) == "ring"


@pytest.mark.parametrize("algorithm", HIER + ["shm", "ring"])
@pytest.mark.parametrize("op,dtype", [("sum", torch.float32), ("avg", torch.float64), ("avg", torch.bfloat16),
                                      ("max", torch.int32)])
def test_fused_batches_in_the_window(algorithm, op, dtype):
    """Fused allreduces pack straight into the shared window and unpack from the owners' segments."""
    topo = pycomm.topology()
    if (algorithm == "shm" and topo.num_nodes > 1) or (algorithm in HIER and not topo.homogeneous):
        pytest.skip("not available on this topology")
    counts = [5, 0, 1, 33, 1001, 3, 20_011, 7]
    xs = [rank_data(topo.rank, n, dtype, seed=80 + i) for i, n in enumerate(counts)]
    outs = [torch.full_like(x, -7) for x in xs]
    before = pycomm.stats()["fused_tensors"]
    hs = [pycomm.allreduce_async(x, op=op, algorithm=algorithm, out=o, name=f"w{i}")
          for i, (x, o) in enumerate(zip(xs, outs))]
    for i, h in enumerate(hs):
        assert_close(h.wait(), op, topo.size, dtype, seed=80 + i, what=f"fused {algorithm} {op} {dtype} w{i}")
    if topo.size > 1:
        assert pycomm.stats()["fused_tensors"] > before
