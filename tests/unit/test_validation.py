"""Bad input is rejected before any communication, with a message naming the problem."""
import pytest
import torch

import pycomm


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    pycomm.init()
    yield


def test_calls_before_init_raise_clearly():
    import subprocess
    import sys

    code = "import pycomm, torch\ntry:\n    pycomm.allreduce(torch.ones(2))\nexcept pycomm.CommError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "call pycomm.init() first" in out.stdout, out.stderr


def test_non_contiguous():
    x = torch.ones(4, 4).t()
    with pytest.raises(ValueError, match="not contiguous"):
        pycomm.allreduce(x)


def test_unsupported_dtype_and_op():
    with pytest.raises(TypeError, match="unsupported dtype complex128; supported: float32, float64, float16, "
                                       "bfloat16, int32, int64, uint8, int8, int16, bool"):
        pycomm.allreduce(torch.ones(3, dtype=torch.complex128))
    with pytest.raises(TypeError, match="unsupported dtype complex64"):
        pycomm.broadcast(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="unknown op 'prod'"):
        pycomm.allreduce(torch.ones(3), op="prod")
    with pytest.raises(TypeError, match="op='avg' needs a floating-point tensor, got int32"):
        pycomm.allreduce(torch.ones(3, dtype=torch.int32), op="avg")
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        pycomm.allreduce(torch.ones(3), algorithm="tree")
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        pycomm.allreduce([1.0, 2.0])


def test_bad_out():
    with pytest.raises(ValueError, match=r"out is torch.float64\[3\].*expected torch.float32\[3\]"):
        pycomm.allreduce(torch.ones(3), out=torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="out is"):
        pycomm.allreduce(torch.ones(3), out=torch.ones(4))


def test_bad_root_and_scalar_allgather():
    with pytest.raises(ValueError, match="root=1 is not a rank of this job"):
        pycomm.broadcast(torch.ones(3), root=1)
    with pytest.raises(ValueError, match="scalar"):
        pycomm.allgather(torch.tensor(1.0))


def test_wrong_device():
    # Only CPU and CUDA tensors are taken, in every build: a CUDA build refuses a meta tensor too.
    meta = torch.ones(3, device="meta")
    with pytest.raises(ValueError, match="meta"):
        pycomm.allreduce(meta)


def test_single_rank_allreduce_is_identity():
    x = torch.randn(101)
    assert torch.equal(pycomm.allreduce(x.clone(), op="avg"), x)
    assert pycomm.size() == 1 and pycomm.rank() == 0
