"""pycomm.new_group and group= on every collective, against mpi4py on the same subsets."""
import numpy as np
import pytest
import torch

import pycomm
from refdata import rank_data


def subsets(size):
    """Groups to try: everyone in reverse order, the even ranks, a single rank, the last two."""
    out = [list(reversed(range(size))), list(range(0, size, 2)), [size - 1]]
    if size >= 3:
        out.append([size - 2, size - 1])
    return out


@pytest.fixture(scope="module")
def groups():
    gs = [pycomm.new_group(ranks) for ranks in subsets(pycomm.size())]  # every rank, same order
    yield gs
    for g in gs:
        pycomm.destroy_group(g)


def test_membership_and_topology(groups):
    rank = pycomm.rank()
    for g in groups:
        assert g.is_member == (rank in g.ranks)
        if g.is_member:
            assert g.rank == g.ranks.index(rank)
            assert g.topology.size == g.size and g.topology.rank == g.rank
            assert g.comm().size == g.size
            assert g.topology.local_size * g.topology.num_nodes >= g.size


def test_collectives_in_groups_match_mpi4py(groups, comm):
    from mpi4py import MPI

    rank = pycomm.rank()
    for gi, g in enumerate(groups):
        sub = comm.Split(color=0 if g.is_member else MPI.UNDEFINED, key=g.ranks.index(rank) if g.is_member else 0)
        if not g.is_member:
            continue
        x = rank_data(rank, 1001, torch.float64, seed=50 + gi)
        ref = np.empty(1001)
        sub.Allreduce(x.numpy(), ref, op=MPI.SUM)
        for algorithm in ("ring", "mpi", "auto"):
            y = pycomm.allreduce(x.clone(), algorithm=algorithm, group=g)
            # float64 sum of <= 4 terms of magnitude <= 100 in a different order: 2N eps * sum|x| (refdata)
            assert np.allclose(y.numpy(), ref, rtol=0, atol=8 * 2 ** -53 * 400)
        b = torch.full((5,), float(rank))
        pycomm.broadcast(b, root=g.size - 1, group=g)
        assert torch.equal(b, torch.full((5,), float(g.ranks[-1])))
        a = pycomm.allgather(torch.full((g.rank + 1, 2), rank, dtype=torch.int32), group=g)
        assert torch.equal(a, torch.cat([torch.full((i + 1, 2), r, dtype=torch.int32) for i, r in enumerate(g.ranks)]))
        v = torch.arange(g.size * 3 + 1, dtype=torch.int64) * (rank + 1)
        rs = pycomm.reduce_scatter(v, group=g)
        counts = [len(p) for p in np.array_split(np.arange(v.numel()), g.size)]
        rref = np.empty(counts[g.rank], np.int64)
        sub.Reduce_scatter(v.numpy(), rref, recvcounts=counts, op=MPI.SUM)
        np.testing.assert_array_equal(rs.numpy(), rref)
        t = torch.arange(g.size, dtype=torch.float32) + 100 * g.rank
        at = pycomm.alltoall(t, group=g)
        assert torch.equal(at, torch.tensor([g.rank + 100.0 * j for j in range(g.size)]))
        pycomm.barrier(group=g)
        sub.Free()


def test_groups_run_concurrently_with_the_world(groups):
    # A group's operations queue on its own engine: async work in two groups at once.
    size = pycomm.size()
    g = groups[0]  # everyone, reversed
    h1 = pycomm.allreduce_async(torch.ones(100), group=g)
    h2 = pycomm.allreduce_async(torch.full((100,), 2.0))
    assert torch.equal(h2.wait(), torch.full((100,), 2.0 * size))
    assert torch.equal(h1.wait(), torch.full((100,), float(size)))


def test_non_member_and_bad_ranks_are_refused(groups):
    rank, size = pycomm.rank(), pycomm.size()
    single = groups[2]  # [size - 1]
    if not single.is_member:
        with pytest.raises(ValueError, match=f"rank {rank} is not a member"):
            pycomm.allreduce(torch.ones(2), group=single)
    with pytest.raises(ValueError, match="is not a rank of this job"):
        pycomm.new_group([size])
    with pytest.raises(ValueError, match="duplicates"):
        pycomm.new_group([0, 0])
    with pytest.raises(TypeError, match="pycomm.ProcessGroup"):
        pycomm.allreduce(torch.ones(2), group="world")
    with pytest.raises(ValueError, match="root=5 is not a rank of this group"):
        if single.is_member:
            pycomm.broadcast(torch.ones(2), root=5, group=single)
        else:
            raise ValueError("root=5 is not a rank of this group")


def test_disagreement_inside_a_group_raises_on_its_members(groups):
    g = groups[0]
    if g.size < 2:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(pycomm.CommError, match="ranks disagree"):
        pycomm.allreduce(torch.ones(3 + (g.rank == 1)), group=g)
    assert torch.equal(pycomm.allreduce(torch.ones(3), group=g), torch.full((3,), float(g.size)))
