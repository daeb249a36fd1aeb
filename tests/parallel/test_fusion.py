"""Tensor fusion: queued allreduces are packed, reduced once and unpacked, identically on every rank."""
import time

import pytest
import torch

import pycomm
from refdata import assert_close, rank_data


def test_many_small_tensors_are_fused_and_correct():
    rank, size = pycomm.rank(), pycomm.size()
    before = pycomm.stats()
    counts = [1, 7, 64, 999, 3, 4097, 0, 12345] * 8
    xs = [rank_data(rank, n, torch.float32, seed=40 + i) for i, n in enumerate(counts)]
    handles = [pycomm.allreduce_async(x, op="sum", name=f"grad.{i}") for i, x in enumerate(xs)]
    for i, h in enumerate(handles):
        assert_close(h.wait(), "sum", size, torch.float32, seed=40 + i, what=f"grad.{i}")
    after = pycomm.stats()
    assert after["operations"] - before["operations"] == len(counts)
    assert after["fused_tensors"] > before["fused_tensors"], "nothing was fused"
    assert after["rounds"] - before["rounds"] < len(counts)


def test_fusion_keeps_dtypes_and_ops_apart():
    rank, size = pycomm.rank(), pycomm.size()
    specs = [(torch.float32, "sum"), (torch.float64, "sum"), (torch.float32, "max"), (torch.float32, "avg"),
             (torch.bfloat16, "sum"), (torch.int32, "min")] * 3
    xs = [rank_data(rank, 301 + i, dt, seed=50 + i) for i, (dt, _) in enumerate(specs)]
    handles = [pycomm.allreduce_async(x, op=op, name=f"t{i}") for i, (x, (_, op)) in enumerate(zip(xs, specs))]
    for i, (h, (dt, op)) in enumerate(zip(handles, specs)):
        assert_close(h.wait(), op, size, dt, seed=50 + i, what=f"t{i} {dt} {op}")


def test_tensor_above_threshold_travels_alone():
    rank, size = pycomm.rank(), pycomm.size()
    old = pycomm.get_options()["fusion_threshold_bytes"]
    pycomm.set_options(fusion_threshold_bytes=4096)
    try:
        xs = [rank_data(rank, n, torch.float32, seed=60 + i) for i, n in enumerate([10, 5000, 10, 10])]
        hs = [pycomm.allreduce_async(x, name=f"s{i}") for i, x in enumerate(xs)]
        for i, h in enumerate(hs):
            assert_close(h.wait(), "sum", size, torch.float32, seed=60 + i, what=f"s{i}")
    finally:
        pycomm.set_options(fusion_threshold_bytes=old)


def test_different_order_is_an_error_naming_the_tensors():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    names = ["layer1.weight", "layer1.bias"]
    if rank == 1:
        names.reverse()
    hs = [pycomm.allreduce_async(torch.ones(8), name=n) for n in names]
    messages = []
    for h in hs:
        with pytest.raises(pycomm.CommError) as err:
            h.wait()
        messages.append(str(err.value))
    assert "'layer1.weight'" in messages[0] and "'layer1.bias'" in messages[0]
    assert "rank 1 passed allreduce 'layer1.bias'" in messages[0]
    # Nothing is lost: the engine goes on.
    assert torch.equal(pycomm.allreduce(torch.ones(3), name="after"), torch.full((3,), float(size)))


def test_stall_warning_names_missing_ranks(capfd):
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs a late rank")
    old = pycomm.get_options()["stall_warning_s"]
    pycomm.set_options(stall_warning_s=0.5)
    try:
        if rank == size - 1:
            time.sleep(2.5)
        pycomm.allreduce(torch.ones(4), name="late.tensor")
    finally:
        pycomm.set_options(stall_warning_s=old)
    pycomm.barrier()
    err = capfd.readouterr().err
    if rank != size - 1:
        assert f"rank {size - 1} has not submitted it" in err, err
        assert "'late.tensor'" in err
