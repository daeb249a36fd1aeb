"""pair_by_name (Horovod's rule): named operations pair across ranks by name, in any order.

References are mpi4py's own Allreduce/allgather of the same data. Horovod's join
(pycomm.join(answer_gathers=False)) is here too: it refuses the others' allgathers
and broadcasts and stays joined.
"""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import pycomm


@pytest.fixture
def by_name():
    pycomm.set_options(pair_by_name=True)
    yield
    pycomm.set_options(pair_by_name=False)


def _data(n, salt):
    rng = np.random.default_rng([pycomm.rank(), salt, n])
    return rng.standard_normal(n)


def _mpi_sum(x):
    out = np.empty_like(x)
    MPI.COMM_WORLD.Allreduce(x, out, op=MPI.SUM)
    return out


def test_named_operation_waits_aside_while_others_run(by_name):
    # Rank 0 submits 'early' before a barrier, the others after it: the barrier runs first
    # while 'early' waits aside on rank 0, then 'early' pairs with the others' by name.
    rank, size = pycomm.rank(), pycomm.size()
    x = _data(1001, 1)
    t = torch.from_numpy(x.copy())
    h = None
    if rank == 0:
        h = pycomm.allreduce_async(t, name="early")
    pycomm.barrier()
    if rank > 0:
        h = pycomm.allreduce_async(t, name="early")
    got = h.wait().numpy()
    np.testing.assert_allclose(got, _mpi_sum(x), rtol=1e-12, atol=1e-12)  # float64 sums: order only
    pycomm.barrier()


def test_names_pair_in_opposite_orders(by_name):
    rank, size = pycomm.rank(), pycomm.size()
    a, b = _data(37, 2), _data(4099, 3)
    names = ["a", "b"] if rank % 2 == 0 else ["b", "a"]
    tensors = {"a": torch.from_numpy(a.copy()), "b": torch.from_numpy(b.copy())}
    kinds = {"a": "allreduce", "b": "allgather"}
    handles = {}
    for n in names:
        if kinds[n] == "allreduce":
            handles[n] = pycomm.allreduce_async(tensors[n], name=n)
        else:
            handles[n] = pycomm.allgather_async(tensors[n].reshape(1, -1), name=n)
    np.testing.assert_allclose(handles["a"].wait().numpy(), _mpi_sum(a), rtol=1e-12, atol=1e-12)
    gathered = np.concatenate(MPI.COMM_WORLD.allgather(b)).reshape(size, -1)
    np.testing.assert_array_equal(handles["b"].wait().numpy(), gathered)


def test_same_name_different_shapes_fails_on_every_rank(by_name):
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    # Submitted in different orders, so the mismatch is found between a parked and a head operation.
    ones = torch.ones(10 + (rank == 1))
    if rank == 0:
        h = pycomm.allreduce_async(ones, name="mismatch")
        pycomm.barrier()
    else:
        pycomm.barrier()
        h = pycomm.allreduce_async(ones, name="mismatch")
    with pytest.raises(pycomm.CommError, match="ranks disagree on the call named 'mismatch'"):
        h.wait()
    # Nothing is lost: the next operations pair and run.
    y = pycomm.allreduce(torch.ones(5), name="after")
    assert torch.equal(y, torch.full((5,), float(size)))


def test_unnamed_operations_still_pair_by_order(by_name):
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(pycomm.CommError, match="ranks disagree on the call"):
        pycomm.allreduce(torch.ones(3 + (rank == 0)))
    assert torch.equal(pycomm.allreduce(torch.ones(2)), torch.full((2,), float(size)))


def test_many_named_operations_in_shuffled_orders(by_name):
    # Every rank submits the same 12 named allreduces in its own random order; each pairs by name.
    rank, size = pycomm.rank(), pycomm.size()
    rng = np.random.default_rng(rank + 100)
    order = rng.permutation(12)
    data = {i: _data(17 * i + 3, 10 + i) for i in range(12)}
    handles = {int(i): pycomm.allreduce_async(torch.from_numpy(data[int(i)].copy()), name=f"shuffled.{i}")
               for i in order}
    for i in range(12):
        np.testing.assert_allclose(handles[i].wait().numpy(), _mpi_sum(data[i]), rtol=1e-12, atol=1e-12)


def test_off_by_default_names_must_come_in_order():
    rank, size = pycomm.rank(), pycomm.size()
    assert pycomm.get_options()["pair_by_name"] is False
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(pycomm.CommError, match="ranks disagree on the call"):
        pycomm.allreduce(torch.ones(3), name=f"order.{rank}")


def test_horovod_join_refuses_gathers_and_stays_joined():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs a rank to join while another calls")
    if rank == 0:
        last = pycomm.join(answer_gathers=False)
    else:
        with pytest.raises(pycomm.CommError, match="Horovod's join refuses allgather"):
            pycomm.allgather(torch.ones(1, 3))
        with pytest.raises(pycomm.CommError, match="Horovod's join refuses broadcast"):
            pycomm.broadcast(torch.ones(3), root=1)
        # Allreduces are still answered by the joined rank (zeros).
        y = pycomm.allreduce(torch.ones(4))
        assert torch.equal(y, torch.full((4,), float(size - 1)))
        last = pycomm.join(answer_gathers=False)
    assert last != 0
    assert MPI.COMM_WORLD.allgather(last) == [last] * size
    # pycomm's own join still answers allgathers.
    if rank == 0:
        pycomm.join()
    else:
        rows = pycomm.allgather(torch.full((1, 2), float(rank)))
        assert rows.shape[0] == size - 1
        pycomm.join()
