"""The same answer whatever the path: NaN with min/max, fp16 averages that overflow,
uneven allgathers through the > 2 GiB ring, option changes and the consistency switch."""
import os
import warnings

import numpy as np
import pytest
import torch

import pycomm
from refdata import rank_data

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _algorithms(path="host"):
    """The algorithms this topology and path run (the device-direct path has no host window:
    shm and hierarchical_master are refused there, test_hierarchical.py checks that)."""
    topo = pycomm.topology()
    window = path != "device-direct"
    algos = ["auto", "ring", "mpi"]
    if topo.num_nodes == 1 and window:
        algos.append("shm")
    if topo.homogeneous:
        algos += ["hierarchical", "hierarchical_master"] if window else ["hierarchical"]
    return algos


def _paths():
    """(label, options) for every way a host tensor can travel."""
    return [("host", {}), ("staged", {"force_staging": True, "staging_chunk_bytes": 1024}),
            ("device-direct", {"force_device_direct": True})]


@pytest.mark.parametrize("path", [p[0] for p in _paths()])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["min", "max"])
def test_nan_propagates_with_min_and_max_on_every_algorithm(op, dtype, path):
    # The rule (as torch.minimum/maximum): a NaN on any rank makes that element NaN
    # everywhere. Rank 0 holds one (the case MPI's own MIN/MAX dropped) and the last
    # rank another; every other element is the exact min/max.
    rank, size = pycomm.rank(), pycomm.size()
    options = dict(_paths())[path]
    old = pycomm.get_options()
    pycomm.set_options(**options)
    try:
        for algorithm in _algorithms(path):
            for count in (5, 1001, 70_000):  # below and above auto's 64 KiB switch to shm/ring
                x = rank_data(rank, count, dtype, seed=7)
                if rank == 0:
                    x[3] = float("nan")
                if rank == size - 1:
                    x[count - 1] = float("nan")
                y = pycomm.allreduce(x.clone(), op=op, algorithm=algorithm)
                stack = np.stack([rank_data(r, count, dtype, seed=7).double().numpy() for r in range(size)])
                ref = stack.min(0) if op == "min" else stack.max(0)
                ref[3] = ref[count - 1] = np.nan
                got = y.double().numpy()
                where = f"{op} {dtype} {algorithm} {path} count={count}"
                assert np.array_equal(np.isnan(got), np.isnan(ref)), where
                assert np.array_equal(got[~np.isnan(ref)], ref[~np.isnan(ref)]), where  # min/max are exact
    finally:
        pycomm.set_options(**{k: old[k] for k in options})


def test_fp16_average_beyond_the_range_is_reported():
    size = pycomm.size()
    if size < 2:
        pytest.skip("a mean of one rank's values is the value, which the input check covers")
    # Each pre-divided term (60000) fits float16; the mean (60000 N) does not.
    x = torch.full((1000,), 60000.0 * size)
    keep = torch.zeros(1000)
    with pytest.raises(pycomm.CommError, match=r"compression='fp16', op='avg'\)"
                                               r".*the average, or a partial sum on the way to it, overflowed"):
        pycomm.allreduce(x, op="avg", compression="fp16", out=keep)
    assert torch.all(keep == 0), "nothing may be written"


def test_fp16_average_with_mixed_signs_is_reported_not_inf():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 3:
        pytest.skip("needs a partial sum of two same-signed terms next to one of the other sign")
    # Pre-divided terms +-60000: the mean fits float16, but a ring partial sum of two
    # positive terms (120000) does not. The result must be an error, never a silent inf.
    sign = 1.0 if rank < (size + 1) // 2 else -1.0
    x = torch.full((4096,), sign * 60000.0 * size)
    with pytest.raises(pycomm.CommError, match="overflowed float16"):
        pycomm.allreduce(x, op="avg", compression="fp16")
    y = pycomm.allreduce(x, op="avg", compression="bf16")  # float32's range: no overflow
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("piece", [1, 16, 100, 4096])
def test_allgather_ring_with_uneven_rows(piece, comm):
    # The > 2 GiB ring (PYCOMM_TEST_ALLGATHER_PIECE_BYTES makes it run on small data):
    # ranks hold different row counts, so their blocks need different numbers of pieces.
    rank, size = pycomm.rank(), pycomm.size()
    os.environ["PYCOMM_TEST_ALLGATHER_PIECE_BYTES"] = str(piece)
    try:
        x = rank_data(rank, (7 * rank + 1) * 3, torch.float32, seed=11).reshape(-1, 3)
        y = pycomm.allgather(x, name="uneven")
        z = pycomm.allgather(torch.zeros(0, 3) if rank == 1 else x, name="uneven.empty")
    finally:
        del os.environ["PYCOMM_TEST_ALLGATHER_PIECE_BYTES"]
    ref = torch.cat([rank_data(r, (7 * r + 1) * 3, torch.float32, seed=11).reshape(-1, 3) for r in range(size)])
    assert torch.equal(y, ref)
    assert torch.equal(z, torch.cat(comm.allgather(torch.zeros(0, 3) if rank == 1 else x)))


def test_allgather_piece_setting_is_checked():
    os.environ["PYCOMM_TEST_ALLGATHER_PIECE_BYTES"] = "lots"
    try:
        with pytest.raises(pycomm.CommError, match="PYCOMM_TEST_ALLGATHER_PIECE_BYTES=lots"):
            pycomm.allgather(torch.ones(2))
    finally:
        del os.environ["PYCOMM_TEST_ALLGATHER_PIECE_BYTES"]


def test_unnamed_async_allreduces_in_flight_warn_once():
    from pycomm import _ops

    _ops._Unnamed.warned, _ops._Unnamed.pending = False, []
    pycomm.set_options(cycle_time_ms=50)  # keep the first one queued while the second is submitted
    try:
        with pytest.warns(UserWarning, match="several unnamed asynchronous allreduces are in flight"):
            hs = [pycomm.allreduce_async(torch.ones(4)) for _ in range(3)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            hs += [pycomm.allreduce_async(torch.ones(4)) for _ in range(3)]
            named = [pycomm.allreduce_async(torch.ones(4), name=f"n{i}") for i in range(3)]
        for h in hs + named:
            assert torch.equal(h.wait(), torch.full((4,), float(pycomm.size())))
    finally:
        pycomm.set_options(cycle_time_ms=2.0)


def test_named_async_allreduces_in_different_orders_are_refused():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    names = ["a", "b"] if rank == 0 else ["b", "a"]
    hs = [pycomm.allreduce_async(torch.ones(4), name=n) for n in names]
    with pytest.raises(pycomm.CommError, match="ranks disagree on the call"):
        for h in hs:
            h.wait()
    for h in hs:  # the rest of the batch fails or completes; nothing hangs
        try:
            h.wait()
        except pycomm.CommError:
            pass
    pycomm.barrier()


@pytest.mark.parametrize("fusion", [True, False])
def test_check_consistency_off_compares_sizes_only(fusion):
    rank, size = pycomm.rank(), pycomm.size()
    old = pycomm.get_options()
    pycomm.set_options(check_consistency=True, fusion_threshold_bytes=old["fusion_threshold_bytes"] if fusion else 0)
    try:
        if size > 1:  # on: names are compared
            with pytest.raises(pycomm.CommError, match="ranks disagree"):
                pycomm.allreduce(torch.ones(6), name=f"on.{rank}")
        pycomm.set_options(check_consistency=False)
        # Off: names and ops are not compared (the switch is observable) ...
        y = pycomm.allreduce(torch.ones(6), name=f"off.{rank}")
        assert torch.equal(y, torch.full((6,), float(size)))
        hs = [pycomm.allreduce_async(torch.ones(5), name=f"async.{rank}.{i}") for i in range(3)]
        for h in hs:
            assert torch.equal(h.wait(), torch.full((5,), float(size)))
        # ... but sizes and dtypes still are, on every algorithm: a mismatch raises on
        # every rank instead of overrunning a buffer (or erroring on one rank only).
        if size > 1:
            for algorithm in _algorithms():
                with pytest.raises(pycomm.CommError, match=r"only sizes are compared"):
                    pycomm.allreduce(torch.ones(100 + (rank == size - 1)), algorithm=algorithm)
                with pytest.raises(pycomm.CommError, match=r"float16\[100\]"):
                    pycomm.allreduce(torch.ones(100, dtype=torch.float16 if rank == 0 else torch.float32),
                                     algorithm=algorithm)
            with pytest.raises(pycomm.CommError, match="broadcast"):
                if rank == 0:
                    pycomm.broadcast(torch.ones(3))
                else:
                    pycomm.allreduce(torch.ones(3))
        z = pycomm.allreduce(torch.ones(3), algorithm="mpi")
        assert torch.equal(z, torch.full((3,), float(size)))
    finally:
        pycomm.set_options(check_consistency=True, fusion_threshold_bytes=old["fusion_threshold_bytes"])


def test_set_options_applies_behind_queued_operations_on_every_rank():
    rank, size = pycomm.rank(), pycomm.size()
    old = pycomm.get_options()
    # Queued while the check is on, with names that differ: it must be checked even
    # though the check is switched off right after (on every rank alike).
    pycomm.set_options(cycle_time_ms=50)
    try:
        h = pycomm.allreduce_async(torch.ones(4), name=f"queued.{rank}")
        pycomm.set_options(check_consistency=False)
        if size > 1:
            with pytest.raises(pycomm.CommError, match="ranks disagree"):
                h.wait()
        else:
            h.wait()
        y = pycomm.allreduce(torch.ones(4), name=f"after.{rank}")  # off now, everywhere
        assert torch.equal(y, torch.full((4,), float(size)))
        if size > 1:  # ranks that pass different options all raise, and nothing changes
            with pytest.raises(pycomm.CommError, match=r"ranks disagree on the call.*set_options"):
                pycomm.set_options(ring_chunk_bytes=4096 * (rank + 1))
            assert pycomm.get_options()["ring_chunk_bytes"] == old["ring_chunk_bytes"]
    finally:
        pycomm.set_options(check_consistency=True, cycle_time_ms=old["cycle_time_ms"])


# ---- real CUDA tensors (skipped without a GPU) -----------------------------------------------------

from cuda_cases import needs_cuda, rank_device  # noqa: E402


@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["min", "max"])
def test_cuda_nan_min_max_and_exact_elsewhere(op, dtype, comm):
    """The host rule on CUDA tensors: a NaN on any rank is NaN everywhere, every other element the
    exact min/max (mpi4py's own, on the host copies), bitwise alike on every rank."""
    rank, size = pycomm.rank(), pycomm.size()
    x = rank_data(rank, 3001, dtype, seed=98)
    if rank == 0:
        x[5] = float("nan")
    if rank == size - 1:
        x[2999] = float("nan")
    y = pycomm.allreduce(x.to(rank_device()), op=op).cpu()
    from mpi4py import MPI

    ref = np.empty(x.numel(), np.float64)
    comm.Allreduce(np.nan_to_num(x.double().numpy(), nan=np.inf if op == "min" else -np.inf), ref,
                   op=MPI.MIN if op == "min" else MPI.MAX)
    got = y.double().numpy()
    assert np.isnan(got[5]) and np.isnan(got[2999])
    keep = np.ones(x.numel(), bool)
    keep[[5, 2999]] = False
    assert np.array_equal(got[keep], ref[keep])
    copies = comm.allgather(y.view(torch.uint8).numpy().tobytes())
    assert all(c == copies[0] for c in copies)
