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


# The blocking call and the asynchronous one (whose fast path hands the call to the engine's binding
# and takes the checked path for whatever the binding refuses) give the same messages.
ALLREDUCE_CALLS = {
    "allreduce": pycomm.allreduce,
    "allreduce_async": lambda t, **kw: pycomm.allreduce_async(t, **kw).wait(),
}


@pytest.mark.parametrize("call", ALLREDUCE_CALLS)
def test_non_contiguous(call):
    x = torch.ones(4, 4).t()
    with pytest.raises(ValueError, match="not contiguous"):
        ALLREDUCE_CALLS[call](x)


@pytest.mark.parametrize("call", ALLREDUCE_CALLS)
def test_unsupported_dtype_and_op(call):
    allreduce = ALLREDUCE_CALLS[call]
    with pytest.raises(TypeError, match="unsupported dtype complex128; supported: float32, float64, float16, "
                                       "bfloat16, int32, int64, uint8, int8, int16, bool"):
        allreduce(torch.ones(3, dtype=torch.complex128))
    with pytest.raises(TypeError, match="unsupported dtype complex64"):
        pycomm.broadcast(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="unknown op 'prod'"):
        allreduce(torch.ones(3), op="prod")
    with pytest.raises(TypeError, match="op='avg' needs a floating-point tensor, got int32"):
        allreduce(torch.ones(3, dtype=torch.int32), op="avg")
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        allreduce(torch.ones(3), algorithm="tree")
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        allreduce([1.0, 2.0])
    with pytest.raises(ValueError, match="unknown op"):
        allreduce(torch.ones(3), op=["sum"])
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        allreduce(None, op="avg")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_binding_refuses_an_integer_average(dtype):
    # The fast paths call the binding with no dtype check of their own: it refuses the average
    # itself, before anything is queued, and the engine goes on.
    from pycomm import _C

    x = torch.ones(5, dtype=dtype)
    with pytest.raises(TypeError, match="an average needs a floating-point tensor"):
        _C.allreduce_async(x, x, "sum", True, "auto", "", False, 0)
    with pytest.raises(TypeError, match="an average needs a floating-point tensor"):
        _C.allreduce_blocking(x, "sum", True, "auto", "")
    assert torch.equal(pycomm.allreduce_async(x, op="max").wait(), torch.ones(5, dtype=dtype))
    y = torch.randn(5, dtype=torch.float64)
    assert torch.equal(_C.allreduce_async(y, y.clone(), "sum", True, "auto", "", False, 0).wait(), y)


def test_allreduce_async_binds_its_arguments_as_python_does():
    # pycomm.allreduce_async is a C function (csrc/bindings/allreduce_entry.cpp): the signature, the
    # defaults and CPython's argument errors, every form of the common call, and the rest through
    # the checked path with all eight arguments.
    import inspect

    assert str(inspect.signature(pycomm.allreduce_async)) == (
        "(tensor, op='sum', algorithm='auto', out=None, name=None, _blocking=False, compression='none', group=None)")
    x = torch.arange(5, dtype=torch.float32)
    assert torch.equal(pycomm.allreduce_async(x.clone()).wait(), x)
    assert torch.equal(pycomm.allreduce_async(x.clone(), "max", "auto", None, "bind.1", True, "none", None).wait(), x)
    assert torch.equal(pycomm.allreduce_async(tensor=x.clone(), name="bind.2", op="avg").wait(), x)
    out = torch.empty_like(x)
    assert pycomm.allreduce_async(x, out=out, name="bind.3").wait() is out and torch.equal(out, x)
    assert torch.equal(pycomm.allreduce_async(x.clone(), compression="fp16", op="avg", name="bind.4").wait(), x)
    for args, kwargs, message in [
            ((), {}, "missing 1 required positional argument: 'tensor'"),
            ((x,), {"zzz": 1}, "unexpected keyword argument 'zzz'"),
            ((x, "sum"), {"op": "max"}, "multiple values for argument 'op'"),
            ((x,) + (None,) * 8, {}, "takes from 1 to 8 positional arguments but 9 were given")]:
        with pytest.raises(TypeError, match=message):
            pycomm.allreduce_async(*args, **kwargs)
    with pytest.raises(ValueError, match="unknown op 'prod'"):
        pycomm.allreduce_async(x, op="prod")
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        pycomm.allreduce_async([1.0, 2.0])


@pytest.mark.parametrize("count", [1, 1003, 70001])  # both sides of the handle's inline division (1 << 16)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_binding_divides_the_sum_once(dtype, count):
    # divide_by (pycomm.horovod's Average): the sum divided once, however often the handle is waited
    # for, bit for bit torch's division of the same sum (IEEE division is correctly rounded). One
    # rank: the sum is the input (tests/parallel/test_horovod_api.py checks 2-4 ranks).
    from pycomm import _C

    ref = torch.randn(count, dtype=dtype) * 1000
    x = ref.clone()
    h = _C.allreduce_async(x, x, "sum", False, "auto", "", False, 0, 3)
    assert torch.equal(h.wait(), ref / 3)
    assert torch.equal(h.wait(), ref / 3) and torch.equal(h.synchronize(), ref / 3)
    y = ref.clone()
    assert torch.equal(_C.allreduce_async(y, y, "sum", False, "auto", "", True, 0, 3).synchronize(), ref / 3)


@pytest.mark.parametrize("divide_by,dtype,op,average", [
    (0, torch.float32, "sum", False), (-2, torch.float32, "sum", False), (2, torch.int32, "sum", False),
    (2, torch.float16, "sum", False), (2, torch.float32, "max", False), (2, torch.float32, "sum", True)])
def test_binding_refuses_a_division_it_cannot_do(divide_by, dtype, op, average):
    from pycomm import _C

    x = torch.ones(4, dtype=dtype)
    with pytest.raises(ValueError, match="divide_by"):
        _C.allreduce_async(x, x, op, average, "auto", "", False, 0, divide_by)
    assert torch.equal(pycomm.allreduce_async(x, op="max").wait(), torch.ones(4, dtype=dtype))


@pytest.mark.parametrize("call", ALLREDUCE_CALLS)
def test_parameters_and_integer_sums_take_the_common_path(call):
    p = torch.nn.Parameter(torch.randn(5))
    with torch.no_grad():
        expected = p.detach().clone()
        assert torch.equal(ALLREDUCE_CALLS[call](p, op="avg"), expected)
    i = torch.arange(7, dtype=torch.int16)
    assert torch.equal(ALLREDUCE_CALLS[call](i, op="max"), torch.arange(7, dtype=torch.int16))


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


@pytest.mark.parametrize("call", ALLREDUCE_CALLS)
def test_wrong_device(call):
    # Only CPU and CUDA tensors are taken, in every build: a CUDA build refuses a meta tensor too.
    meta = torch.ones(3, device="meta")
    with pytest.raises(ValueError, match="meta"):
        ALLREDUCE_CALLS[call](meta)


def test_single_rank_allreduce_is_identity():
    x = torch.randn(101)
    assert torch.equal(pycomm.allreduce(x.clone(), op="avg"), x)
    assert pycomm.size() == 1 and pycomm.rank() == 0
