"""Ranks that disagree get the same clear error everywhere, and nothing is lost."""
import pytest
import torch

import pycomm


def test_dtype_mismatch_is_named_on_every_rank():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    dtype = torch.float16 if rank == size - 1 else torch.float32
    x = torch.ones(1000, dtype=dtype)
    with pytest.raises(pycomm.CommError) as err:
        pycomm.allreduce(x, algorithm="ring")
    msg = str(err.value)
    assert f"rank {size - 1} passed allreduce float16[1000]" in msg
    assert "passed allreduce float32[1000]" in msg
    # State survives: the next agreeing call works.
    y = pycomm.allreduce(torch.ones(5), algorithm="ring")
    assert torch.equal(y, torch.full((5,), float(size)))


def test_shape_op_and_kind_mismatches():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(pycomm.CommError, match=r"float32\[10\].*float32\[11\]|float32\[11\].*float32\[10\]"):
        pycomm.allreduce(torch.ones(10 + (rank == 1)))
    with pytest.raises(pycomm.CommError, match="op=max"):
        pycomm.allreduce(torch.ones(3), op="max" if rank == 0 else "sum")
    with pytest.raises(pycomm.CommError, match="broadcast"):
        if rank == 0:
            pycomm.broadcast(torch.ones(3))
        else:
            pycomm.allreduce(torch.ones(3))
    with pytest.raises(pycomm.CommError, match="allgather float32\\[\\*, 4\\].*allgather float32\\[\\*, 5\\]"):
        pycomm.allgather(torch.ones(rank + 1, 4 if rank == 0 else 5))
    pycomm.barrier()


def test_check_can_be_switched_off_and_on():
    # Observable: the ranks name the call differently. On, that is a disagreement
    # on every rank; off, names are not compared and the allreduce runs.
    rank, size = pycomm.rank(), pycomm.size()
    assert pycomm.get_options()["check_consistency"] is True
    if size > 1:
        with pytest.raises(pycomm.CommError, match="ranks disagree on the call"):
            pycomm.allreduce(torch.ones(7), name=f"switch.{rank}")
    pycomm.set_options(check_consistency=False)
    try:
        y = pycomm.allreduce(torch.ones(7), name=f"switch.{rank}")
    finally:
        pycomm.set_options(check_consistency=True)
    assert torch.equal(y, torch.full((7,), float(size)))
    if size > 1:  # and back on
        with pytest.raises(pycomm.CommError, match="ranks disagree on the call"):
            pycomm.allreduce(torch.ones(7), name=f"switch.again.{rank}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: one rank passes CPU memory, one CUDA")
def test_cpu_and_cuda_tensors_disagree():
    # The device is in the signature: CPU on one rank and CUDA on another would take
    # different data paths, so it is an error, with or without the full check.
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    device = "cuda" if rank == 0 else "cpu"
    for check in (True, False):
        pycomm.set_options(check_consistency=check)
        with pytest.raises(pycomm.CommError, match=r"float32\[6\] on cuda"):
            pycomm.allreduce(torch.ones(6, device=device), algorithm="ring")
    pycomm.set_options(check_consistency=True)
    y = pycomm.allreduce(torch.ones(5), algorithm="ring")
    assert torch.equal(y, torch.full((5,), float(size)))
