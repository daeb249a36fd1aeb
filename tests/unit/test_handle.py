"""pycomm.Handle, the object every asynchronous collective returns (csrc/bindings/handle.cpp): what a
user can do with it on one rank. Its errors from other ranks are tests/parallel's (test_fusion.py,
test_pair_by_name.py)."""
import gc
import weakref

import numpy as np
import pytest
import torch

import pycomm


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    pycomm.init()
    yield


def fresh(n):
    return torch.from_numpy(np.random.default_rng().standard_normal(n).astype(np.float32))


def test_every_face_returns_the_same_type():
    x = fresh(37)
    handles = [pycomm.allreduce_async(x, name="handle.fast"),  # the C entry's common call
               pycomm.allreduce_async(x, out=torch.empty_like(x), name="handle.checked"),  # the checked path
               pycomm.allreduce_async(x.clone(), compression="fp16", name="handle.fp16"),
               pycomm.broadcast_async(x.clone(), 0, name="handle.bcast"),
               pycomm.allgather_async(x.clone(), name="handle.gather")]
    for h in handles:
        assert type(h) is pycomm.Handle
        h.wait()
    assert pycomm.Handle is pycomm._C.CompressedHandle  # the older name of the same type


def test_wait_returns_the_result_tensor_itself_every_time():
    x = fresh(1001)
    expected = x.clone()
    h = pycomm.allreduce_async(x, name="handle.same")
    first = h.wait()
    assert first is x and h.wait() is x and h.synchronize() is x
    assert torch.equal(x, expected)  # one rank: the sum is the tensor
    assert h.done()


def test_allgather_result_gets_its_shape_once_waited():
    x = fresh(12).reshape(3, 4)
    out = pycomm.allgather_async(x, name="handle.rows").wait()
    assert out.shape == (3, 4) and torch.equal(out, x)


def test_repr_names_the_operation_and_its_state():
    h = pycomm.allreduce_async(fresh(5), name="handle.repr")
    h.wait()
    assert repr(h) == "<pycomm.Handle allreduce handle.repr done>"


def test_byte_counts_belong_to_compressed_allreduces():
    h = pycomm.allreduce_async(fresh(9), name="handle.bytes")
    h.wait()
    with pytest.raises(ValueError, match="byte counts belong to compressed allreduces; this is allreduce"):
        h.wire_bytes
    with pytest.raises(ValueError, match="byte counts belong to compressed allreduces"):
        h.fp32_ring_bytes
    c = pycomm.allreduce_async(fresh(1000), compression="onebit", name="handle.onebit")
    c.wait()
    assert isinstance(c.wire_bytes, int) and isinstance(c.fp32_ring_bytes, int)
    assert c.wire_bytes == 0  # one rank sends nothing


def test_cannot_be_made_subclassed_or_given_attributes():
    with pytest.raises(TypeError, match="cannot create 'pycomm._C.Handle' instances"):
        pycomm.Handle()
    with pytest.raises(TypeError):
        type("Sub", (pycomm.Handle,), {})
    h = pycomm.allreduce_async(fresh(3), name="handle.attr")
    h.wait()
    with pytest.raises(AttributeError):
        h.extra = 1


def test_weak_references_and_release():
    x = fresh(64)
    h = pycomm.allreduce_async(x, name="handle.weak")
    ref = weakref.ref(h)
    h.wait()
    del h
    gc.collect()
    assert ref() is None


def test_dropped_unwaited_handle_keeps_its_tensor_until_done():
    # The work keeps the tensor alive (the keepalive), not the handle: dropping the handle first is safe.
    x = fresh(4096)
    expected = x.clone()
    pycomm.allreduce_async(x, name="handle.dropped")
    del x
    gc.collect()
    y = pycomm.allreduce(expected.clone(), name="handle.after")  # runs after the dropped one
    assert torch.equal(y, expected)


def test_method_signatures_are_introspectable():
    import inspect
    assert str(inspect.signature(pycomm.Handle.wait)) == "(self, /)"
    assert "result tensor" in pycomm.Handle.wait.__doc__
