"""Horovod's torch API (horovod.torch.mpi_ops) over pycomm's collectives.

Semantics follow Horovod 0.28: ``allreduce`` is out of place and averages by
default, ``allreduce_`` works in place; the ``*_async`` forms return an
integer handle for ``poll()`` / ``synchronize()``; ``op`` is one of
``Average``, ``Sum``, ``Min``, ``Max``, ``Product`` (``Adasum`` raises
NotImplementedError); ``prescale_factor`` multiplies every rank's input
before the reduction and ``postscale_factor`` the result after it (Sum and
Average). The out-of-place collectives are differentiable: the backward of
an allreduce is the same allreduce of the gradient, of an allgather an
averaging allreduce of the gradient cut back to this rank's rows, of a
broadcast an averaging allreduce kept on the root only (zero elsewhere), of
an alltoall the alltoall back, of a reducescatter an allgather of the
gradient (divided by the set's size for Average).

Only pycomm's public API is used: ``Average`` maps to ``op="avg"``, a
process set is a ``pycomm.new_group`` group, handles are ``pycomm.Handle``.
"""
from __future__ import annotations

import itertools
import numbers
from typing import Dict, List, Optional

import torch

import pycomm
from pycomm import _C, _ops

from .compression import Compression, _is_onebit
from .process_sets import ProcessSet, _group, global_process_set

# Horovod's ReduceOp values.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
_PYCOMM_OP = {Average: "avg", Sum: "sum", Min: "min", Max: "max"}


class HorovodInternalError(RuntimeError):
    """Raised when a collective fails (Horovod's name; wraps pycomm.CommError)."""


# -- basics --------------------------------------------------------------------

def init(comm=None, process_sets=None) -> None:
    """Start pycomm (MPI, the engine); ``process_sets``: ProcessSet objects to register right away."""
    if comm is not None:
        MPI = pycomm.runtime.mpi()
        ranks = comm if isinstance(comm, (list, tuple)) else None
        if ranks is None and comm.Get_size() != MPI.COMM_WORLD.Get_size():
            raise ValueError("pycomm.horovod.init: comm= must span all of MPI.COMM_WORLD; for a subset use "
                             "hvd.add_process_set(ranks)")
        if ranks is not None and sorted(ranks) != list(range(MPI.COMM_WORLD.Get_size())):
            raise ValueError("pycomm.horovod.init: comm= as a list of ranks must name every rank; for a subset use "
                             "hvd.add_process_set(ranks)")
    pycomm.init()
    # Horovod pairs named operations by name in any order, not by submission order.
    if not pycomm.get_options()["pair_by_name"]:
        pycomm.set_options(pair_by_name=True)
    if process_sets == "dynamic":
        return
    for ps in process_sets or ():
        from .process_sets import add_process_set

        add_process_set(ps)


def shutdown() -> None:
    from .process_sets import _remove_all

    if pycomm.is_initialized():
        _remove_all()
    pycomm.shutdown()


def is_initialized() -> bool:
    return pycomm.is_initialized()


def rank() -> int:
    return pycomm.rank()


def size() -> int:
    return pycomm.size()


def local_rank() -> int:
    return pycomm.local_rank()


def local_size() -> int:
    return pycomm.local_size()


def cross_rank() -> int:
    """Index of this rank's node (Horovod: rank among the ranks with this local rank)."""
    return pycomm.node_rank()


def cross_size() -> int:
    """Number of nodes holding a rank with this local rank."""
    return pycomm.cross_comm().Get_size()


def is_homogeneous() -> bool:
    return pycomm.topology().homogeneous


def mpi_threads_supported() -> bool:
    pycomm.topology()
    return True  # pycomm.init() requires MPI_THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    return bool(pycomm.cuda_built)


# -- handles -------------------------------------------------------------------

_handles = itertools.count(1)
# id -> (pycomm handles, finisher returning the result, tensors the engine uses). Python holds every
# tensor the engine reads or writes until synchronize(): the engine then never drops the last
# reference to a tensor that still has a Python object (which would need the GIL on its thread).
_handle_map: Dict[int, tuple] = {}


# Names of operations in flight (Horovod: a second operation with the name of one that has not
# finished is a ValueError, raised before anything is submitted).
_inflight: Dict[str, int] = {}
_name_of: Dict[int, str] = {}  # the reverse of _inflight: synchronize() drops a name without a scan


def _named(name, what: str, start) -> int:
    """Run `start()` (which submits and returns a handle) unless `name` is already in flight."""
    if name:
        other = _inflight.get(name)
        if other is not None and other in _handle_map and not all(h.done() for h in _handle_map[other][0]):
            raise ValueError(f"pycomm.horovod.{what}: an operation named {name!r} is still in flight (handle "
                             f"{other}); Horovod requires a different name for each tensor being processed "
                             "(synchronize the first one, or use another name)")
    h = start()
    if name:
        _inflight[name] = h
        _name_of[h] = name
    return h


def _register(handles, finish, keep=()) -> int:
    """finish: returns the result once `handles` are waited for; None: the result is keep[0]."""
    h = next(_handles)
    _handle_map[h] = (list(handles), finish, tuple(keep))
    return h


def poll(handle: int) -> bool:
    """True once the operation behind `handle` has finished; synchronize() then does not block."""
    if handle not in _handle_map:
        raise ValueError(f"pycomm.horovod.poll: unknown handle {handle!r} (already synchronized?)")
    return all(h.done() for h in _handle_map[handle][0])


def synchronize(handle: int):
    """Wait for the operation behind `handle` and return its result (None for an unknown handle, as Horovod)."""
    entry = _handle_map.pop(handle, None)
    if entry is None:
        return None
    handles, finish, keep = entry
    if _name_of:
        name = _name_of.pop(handle, None)
        if name is not None and _inflight.get(name) == handle:
            del _inflight[name]
    try:
        for h in handles:
            h.wait()
    except pycomm.CommError as e:
        raise HorovodInternalError(str(e)) from e
    return keep[0] if finish is None else finish()


# -- allreduce -------------------------------------------------------------------

def _resolve_op(average, op, what: str) -> int:
    if average is not None and op is not None:
        raise ValueError(f"pycomm.horovod.{what}: give either op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise NotImplementedError(f"pycomm.horovod.{what}: op=hvd.Adasum is not implemented by pycomm; use "
                                  "hvd.Average or hvd.Sum")
    if op not in _OP_NAMES:
        raise ValueError(f"pycomm.horovod.{what}: unknown op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max "
                         "or hvd.Product")
    return op


def _check_scales(op: int, prescale_factor, postscale_factor, what: str) -> None:
    if op not in (Sum, Average) and (prescale_factor != 1.0 or postscale_factor != 1.0):
        raise ValueError(f"pycomm.horovod.{what}: prescale_factor/postscale_factor apply to hvd.Sum and "
                         f"hvd.Average, not to hvd.{_OP_NAMES[op]}")


def _scaled(t, factor):
    """t * factor out of place. Integers as Horovod scales them: in float64, truncated toward zero
    (docs/compatibility.md); floating types in their own precision (fp16/bf16 computed in fp32)."""
    if t.dtype.is_floating_point:
        return t * factor
    return (t.to(torch.float64) * factor).to(t.dtype)


def _postscale_(t, factor, n: int = 1) -> None:
    """t *= factor / n in place: Horovod's postscale, n the set's size for Average (1 otherwise).
    Floating types are multiplied by `factor`, then divided by n: a correctly rounded quotient, where a
    multiplication by 1/n can be one rounding step off (at n = 3, for a third of small integers).
    Integers as Horovod scales them: x * (factor / n) in float64, truncated toward zero."""
    if factor == 1.0 and n == 1:
        return
    if t.dtype.is_floating_point:
        if factor != 1.0:
            t.mul_(factor)
        if n != 1:
            t.div_(n)
    else:
        t.copy_(_scaled(t, factor / n))


_HALF = (torch.float16, torch.bfloat16)
_HANDLE_DIVIDES = (torch.float32, torch.float64)


def _average_rule(op: int, dtype, n: int):
    """Horovod's Average over n ranks is the sum divided by n, a correctly rounded quotient
    (docs/compatibility.md), with n the set's size also while ranks have joined (they add zeros;
    pycomm's own op="avg" divides by the ranks that contributed instead, so it cannot stand in even
    where times 1/n would be exact). Returns (op to run, n to divide the result by afterwards in
    _postscale_, or 1). fp16/bf16 keep pycomm's avg, which divides before the sum (a sum of large fp16
    values overflows before a later division could help)."""
    if op == Average and dtype not in _HALF:
        return Sum, n
    return op, 1


def _prepare(tensor, output, prescale_factor):
    """The source the engine reads (prescaled; in place: `output` itself) and the contiguous tensor it
    writes (`output`, or a contiguous stand-in copied back by the finisher)."""
    src = tensor.detach()
    if prescale_factor != 1.0:
        src = _scaled(src, prescale_factor)
        if output is tensor:
            with torch.no_grad():
                output.copy_(src)
            src = output.detach()
    if not src.is_contiguous():
        src = src.contiguous()
    return src, (output if output.is_contiguous() else torch.empty_like(src))


def _allreduce_start(tensor, output, name, op, prescale_factor, postscale_factor, process_set,
                     blocking: bool = False) -> int:
    """Start tensor -> output (output may be tensor); returns a Horovod handle. blocking: the caller
    synchronizes at once, so an idle engine runs the allreduce on this thread (pycomm.allreduce's
    path) instead of handing it to its worker."""
    if output is tensor and process_set is global_process_set and prescale_factor == 1.0 \
            and postscale_factor == 1.0 and (op == Sum or op == Average):
        h = _in_place_fast(tensor, name, op, blocking)
        if h is not None:
            return h
    what = "allreduce"
    _check_scales(op, prescale_factor, postscale_factor, what)
    group = _group(process_set, what)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pycomm.horovod.{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    op, divisor = _average_rule(op, tensor.dtype, _set_size(process_set))
    if op == Product:
        n = process_set.size() if process_set is not None else size()
        flat = tensor.detach().reshape(1, -1).contiguous()
        hg = pycomm.allgather_async(flat, name=name, group=group)

        def finish_prod():
            with torch.no_grad():
                output.copy_(hg.wait().reshape(n, -1).prod(dim=0).view_as(output))
            return output

        return _register([hg], finish_prod, (flat, output))
    src, out = _prepare(tensor, output, prescale_factor)
    # In place (src a view of the caller's tensor, written there): out=None takes allreduce_async's fast path.
    in_place = output is tensor and out is output
    h = pycomm.allreduce_async(src, op=_PYCOMM_OP[op], out=None if in_place else out, name=name, group=group,
                               _blocking=blocking)

    if out is output and postscale_factor == 1.0 and divisor == 1:
        return _register([h], lambda: output, (src, out))  # the common Sum: nothing left to do

    def finish():
        # On a detached view: the caller's tensor is written in place without autograd (Horovod's
        # semantics), without the cost of entering no_grad once per tensor.
        result = output.detach()
        if out is not output:
            result.copy_(out)
        _postscale_(result, postscale_factor, divisor)
        return output

    return _register([h], finish, (src, out, output))


def _in_place_fast(tensor, name, op, blocking, stacklevel: int = 5) -> Optional[int]:
    """The common call, in place over all ranks without scale factors (allreduce_async_, the
    DistributedOptimizer's hooks), straight to the engine's binding, as pycomm.allreduce_async's C
    entry goes: the binding checks the tensor (dtype, device, layout) before it queues anything, and
    what it refuses returns None for the checked path's messages. Average as _average_rule says;
    stacklevel: the unnamed-handle warning's. bench/submit_cost.py times it."""
    try:
        op, divisor = _average_rule(op, tensor.dtype, pycomm.size())
        # float32/float64: the handle divides the sum when it is waited for (Handle.divide_result_by),
        # the same correctly rounded quotient as _postscale_, without a torch call per tensor.
        divide_by = divisor if tensor.dtype in _HANDLE_DIVIDES else 1
        h = _C.allreduce_async(tensor, tensor, "sum", op == Average, "auto", name or "", blocking, 0, divide_by)
    except (AttributeError, TypeError, ValueError):
        return None
    if not blocking and not name:
        _ops.note_unnamed(h, stacklevel=stacklevel)
    if divisor == divide_by:
        return _register([h], None, (tensor,))

    def finish():
        _postscale_(tensor.detach(), 1.0, divisor)  # a view: in place, without autograd (Horovod's semantics)
        return tensor

    return _register([h], finish, (tensor,))


def _out_of_place(tensor, name, op, prescale_factor, postscale_factor, process_set, blocking=False) -> int:
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _named(name, "allreduce_async", lambda: _allreduce_start(tensor, output, name, op, prescale_factor,
                                                                     postscale_factor, process_set, blocking))


def _in_place(tensor, name, op, prescale_factor, postscale_factor, process_set, blocking=False) -> int:
    return _named(name, "allreduce_async_", lambda: _allreduce_start(tensor, tensor, name, op, prescale_factor,
                                                                      postscale_factor, process_set, blocking))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an out-of-place allreduce; ``synchronize(handle)`` returns the result (input untouched)."""
    op = _resolve_op(average, op, "allreduce_async")
    return _out_of_place(tensor, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce; ``synchronize(handle)`` returns `tensor`."""
    # The common call (Average or Sum over all ranks, no scale factors, a name not in flight) goes
    # straight to _in_place_fast; anything else, valid or not, takes the checked path below.
    if average is None and (op is None or op == Average or op == Sum) and prescale_factor == 1.0 \
            and postscale_factor == 1.0 and process_set is global_process_set and not (name and name in _inflight):
        h = _in_place_fast(tensor, name, Average if op is None else op, False, stacklevel=4)  # the caller's line
        if h is not None:
            if name:
                _inflight[name] = h
                _name_of[h] = name
            return h
    op = _resolve_op(average, op, "allreduce_async_")
    return _in_place(tensor, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set: ProcessSet = global_process_set):
    """In-place allreduce; returns `tensor`."""
    op = _resolve_op(average, op, "allreduce_async_")
    return synchronize(_in_place(tensor, name, op, prescale_factor, postscale_factor, process_set, blocking=True))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, prescale_factor, postscale_factor, process_set
        return synchronize(_out_of_place(tensor, name, op, prescale_factor, postscale_factor, process_set,
                                         blocking=True))

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.op not in (Sum, Average):
            raise RuntimeError(f"pycomm.horovod.allreduce: no gradient for op=hvd.{_OP_NAMES[ctx.op]}; "
                               "differentiate through hvd.Sum or hvd.Average")
        grad = synchronize(_out_of_place(grad_output.contiguous(), None, ctx.op, ctx.pre, ctx.post,
                                         ctx.process_set, blocking=True))
        return grad, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set: ProcessSet = global_process_set):
    """Out-of-place allreduce (default: the average over the process set); differentiable."""
    op = _resolve_op(average, op, "allreduce")
    if _is_onebit(compression):
        _check_scales(op, prescale_factor, postscale_factor, "allreduce")
        if op not in (Sum, Average):
            raise ValueError("pycomm.horovod.allreduce: Compression.onebit reduces with hvd.Average or hvd.Sum")
        if process_set is not global_process_set and process_set is not None:
            raise ValueError("pycomm.horovod.allreduce: Compression.onebit runs over all ranks (global_process_set)")
        if not name:
            raise ValueError("pycomm.horovod.allreduce: Compression.onebit keeps error-feedback state per tensor "
                             "name; pass name=")
        src = tensor.detach() * prescale_factor if prescale_factor != 1.0 else tensor.detach()
        out = torch.empty_like(src)
        pycomm.allreduce(src.contiguous(), op=_PYCOMM_OP[op], out=out, name=name, compression="onebit")
        return out.mul_(postscale_factor) if postscale_factor != 1.0 else out
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def _grouped_start(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set, what) -> int:
    """Start tensors[i] -> outputs[i] as one pycomm.grouped_allreduce (one submission; they fuse in the
    engine); hvd.Product goes tensor by tensor (an allgather each)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"pycomm.horovod.{what}: expected a list of tensors, got {type(tensors).__name__}")
    _check_scales(op, prescale_factor, postscale_factor, what)
    if op == Product or not all(isinstance(t, torch.Tensor) for t in tensors):
        return _register_group([_allreduce_start(t, o, f"{name}.{i}" if name else None, op, prescale_factor,
                                                 postscale_factor, process_set)
                                for i, (t, o) in enumerate(zip(tensors, outputs))])
    divisor = 1
    if op == Average:  # one rule for the group (_average_rule), else each tensor on its own path
        n = _set_size(process_set)
        rules = {_average_rule(op, t.dtype, n) for t in tensors}
        if len(rules) == 1:
            op, divisor = rules.pop()
        elif not any(t.dtype in _HALF for t in tensors):  # floats with integers: one sum, then / n
            op, divisor = Sum, n
        else:  # fp16/bf16 mixed with other dtypes
            return _register_group([_allreduce_start(t, o, f"{name}.{i}" if name else None, op, prescale_factor,
                                                     postscale_factor, process_set)
                                    for i, (t, o) in enumerate(zip(tensors, outputs))])
    group = _group(process_set, what)
    srcs, outs = [], []
    for t, output in zip(tensors, outputs):
        src, out = _prepare(t, output, prescale_factor)
        srcs.append(src)
        outs.append(out)
    in_place = all(o.data_ptr() == s.data_ptr() for o, s in zip(outs, srcs))
    h = pycomm.grouped_allreduce_async(srcs, op=_PYCOMM_OP[op], outs=None if in_place else outs, name=name,
                                       group=group)

    def finish():
        with torch.no_grad():
            for out, output in zip(outs, outputs):
                if out is not output:
                    output.copy_(out)
                _postscale_(output, postscale_factor, divisor)
        return list(outputs)

    return _register([h], finish, (srcs, outs, outputs))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start out-of-place allreduces of a list of tensors in one submission (they fuse in the engine);
    synchronize -> list."""
    op = _resolve_op(average, op, "grouped_allreduce_async")
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) if isinstance(t, torch.Tensor) else t
               for t in tensors] if isinstance(tensors, (list, tuple)) else tensors
    return _grouped_start(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set,
                          "grouped_allreduce_async")


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set: ProcessSet = global_process_set) -> int:
    op = _resolve_op(average, op, "grouped_allreduce_async_")
    return _grouped_start(tensors, tensors, name, op, prescale_factor, postscale_factor, process_set,
                          "grouped_allreduce_async_")


def _register_group(subs: List[int]) -> int:
    handles = [h for s in subs for h in _handle_map[s][0]]

    def finish():
        return [synchronize(s) for s in subs]

    return _register(handles, finish)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set: ProcessSet = global_process_set):
    """Out-of-place allreduce of every tensor of the list; differentiable; returns a list."""
    op = _resolve_op(average, op, "grouped_allreduce")
    if (compression is Compression.none and isinstance(tensors, (list, tuple))
            and not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)):
        # Nothing to differentiate: the whole list in one submission.
        return synchronize(grouped_allreduce_async(tensors, None, name, op, prescale_factor, postscale_factor,
                                                   process_set))
    return [allreduce(t, None, f"{name}.{i}" if name else None, compression, op, prescale_factor, postscale_factor,
                      process_set) for i, t in enumerate(tensors)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set: ProcessSet = global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# -- allgather -------------------------------------------------------------------

def allgather_async(tensor, name=None, process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather (concatenation along dim 0, first dimensions may differ)."""
    def start():
        src = tensor.detach().contiguous()
        h = pycomm.allgather_async(src, name=name, group=_group(process_set, "allgather"))
        return _register([h], h.wait, (src,))

    return _named(name, "allgather_async", start)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        rows = synchronize(allgather_async(torch.tensor([ctx.rows], dtype=torch.int64), None, ctx.process_set))
        me = _set_rank(ctx.process_set)
        offset = int(rows[:me].sum())
        return grad.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set: ProcessSet = global_process_set):
    """Every rank's `tensor` concatenated along dim 0 in rank order; differentiable."""
    if tensor.dim() == 0:
        raise ValueError("pycomm.horovod.allgather: tensor is a scalar; give it at least one dimension")
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather of every tensor of the list (queued together); synchronize returns the list."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"pycomm.horovod.grouped_allgather: expected a list of tensors, got {type(tensors).__name__}")
    group = _group(process_set, "grouped_allgather")
    srcs, handles = [], []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pycomm.horovod.grouped_allgather: expected torch.Tensors, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError("pycomm.horovod.grouped_allgather: a tensor is a scalar; give it at least one dimension")
        src = t.detach().contiguous()
        srcs.append(src)
        handles.append(pycomm.allgather_async(src, name=f"{name}.{i}" if name else None, group=group))
    return _register(handles, lambda: [h.wait() for h in handles], srcs)


def grouped_allgather(tensors, name=None, process_set: ProcessSet = global_process_set):
    """allgather of every tensor of the list (queued together); differentiable; returns a list."""
    if isinstance(tensors, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return [allgather(t, f"{name}.{i}" if name else None, process_set) for i, t in enumerate(tensors)]
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def sparse_allreduce_async(tensor, name, op, process_set: ProcessSet = global_process_set):
    """Start the allreduce of a sparse COO tensor as Horovod does it: an allgather of every rank's
    indices and values; the result holds all of them (entries at the same index add up when it is
    coalesced), values divided by the set's size for hvd.Average. Returns a function that waits and
    returns the sparse result (Horovod's handle for this call)."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError("pycomm.horovod.sparse_allreduce_async: expected a sparse COO tensor, got "
                        f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    op = _resolve_op(None, op, "sparse_allreduce_async")
    if op not in (Sum, Average):
        raise ValueError("pycomm.horovod.sparse_allreduce_async: op must be hvd.Average or hvd.Sum")
    # allgather concatenates along dim 0: indices go as (nnz, sparse_dim) rows.
    hi = allgather_async(tensor._indices().t().contiguous(), name=f"{name}.indices" if name else None,
                         process_set=process_set)
    hv = allgather_async(tensor._values().contiguous(), name=f"{name}.values" if name else None,
                         process_set=process_set)
    n = _set_size(process_set)

    def result():
        values = synchronize(hv)
        indices = synchronize(hi)
        if op == Average:
            values = values / n
        return torch.sparse_coo_tensor(indices.t(), values, tensor.size())

    return result


def _set_rank(process_set) -> int:
    return rank() if process_set is None or process_set is global_process_set else process_set.rank()


def _set_size(process_set) -> int:
    return size() if process_set is None or process_set is global_process_set else process_set.size()


# -- broadcast -------------------------------------------------------------------

def _check_root(root_rank, process_set, what) -> int:
    """Horovod numbers root_rank in the world (also with a process set); returns its rank within the set."""
    if process_set is None or process_set is global_process_set:
        members = list(range(size()))
    else:
        _group(process_set, what)
        members = process_set.ranks
    if not isinstance(root_rank, int) or isinstance(root_rank, bool) or root_rank not in members:
        raise ValueError(f"pycomm.horovod.{what}: root_rank={root_rank!r} is not a rank of the process set "
                         f"(world ranks {members[0]}..{members[-1]})" if len(members) > 1 and
                         members == list(range(members[0], members[-1] + 1)) else
                         f"pycomm.horovod.{what}: root_rank={root_rank!r} is not a rank of the process set "
                         f"(world ranks {members})")
    return members.index(root_rank)


def broadcast_async_(tensor, root_rank, name=None, process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place broadcast from `root_rank`."""
    root = _check_root(root_rank, process_set, "broadcast_async_")
    if not tensor.is_contiguous():
        raise ValueError(f"pycomm.horovod.broadcast_: tensor{' ' + repr(name) if name else ''} is not contiguous; "
                         "pass tensor.contiguous() (the in-place result must land in the same memory)")
    data = tensor.detach()

    def start():
        h = pycomm.broadcast_async(data, root=root, name=name, group=_group(process_set, "broadcast"))
        return _register([h], lambda: tensor, (data, tensor))

    return _named(name, "broadcast_async_", start)


def broadcast_async(tensor, root_rank, name=None, process_set: ProcessSet = global_process_set) -> int:
    """Start an out-of-place broadcast; the input is not modified."""
    root = _check_root(root_rank, process_set, "broadcast_async")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)

    def start():
        h = pycomm.broadcast_async(out, root=root, name=name, group=_group(process_set, "broadcast"))
        return _register([h], lambda: out, (out,))

    return _named(name, "broadcast_async", start)


def broadcast_(tensor, root_rank, name=None, process_set: ProcessSet = global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        if rank() != ctx.root:  # root_rank is a world rank
            grad = torch.zeros_like(grad)
        return grad, None, None, None


def broadcast(tensor, root_rank, name=None, process_set: ProcessSet = global_process_set):
    """Root's `tensor` on every rank (out of place); differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall -------------------------------------------------------------------

def _splits_list(splits) -> Optional[List[int]]:
    """Row counts as ints. Anything but whole numbers is refused on the calling rank, before any
    collective: Horovod requires an int32 splits tensor, and a float one (say torch.empty's
    leftovers) converted by int() would give each rank its own counts, or fail on some ranks only
    and leave the others waiting in the alltoall."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"pycomm.horovod.alltoall: splits must be an int32 tensor (int64 is taken too), "
                             f"got {str(splits.dtype).replace('torch.', '')}")
        return splits.tolist()
    splits = list(splits)
    bad = [s for s in splits if not isinstance(s, numbers.Integral)]
    if bad:
        raise ValueError(f"pycomm.horovod.alltoall: splits must be whole numbers, got {bad[0]!r}")
    return [int(s) for s in splits]


def alltoall_async(tensor, splits=None, name=None, process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall; synchronize returns (output, received_splits)."""
    group = _group(process_set, "alltoall")
    n = _set_size(process_set)
    sp = _splits_list(splits)
    if sp is None:
        if tensor.dim() == 0 or tensor.shape[0] % n:
            raise ValueError(f"pycomm.horovod.alltoall: the first dimension ({tuple(tensor.shape)[:1]}) is not "
                             f"divisible by {n} ranks; pass splits=")
        sp = [tensor.shape[0] // n] * n
    src = tensor.detach().contiguous()
    h = pycomm.alltoall_async(src, splits=sp, name=name, group=group)
    # Each rank learns how many rows it receives from every other one.
    if len(sp) != n:
        raise ValueError(f"pycomm.horovod.alltoall: splits has {len(sp)} entries; give one per rank ({n})")
    sent = torch.tensor(sp, dtype=torch.int32)
    hs = pycomm.alltoall_async(sent, name=f"{name}.splits" if name else None, group=group)
    return _register([h, hs], lambda: (h.wait(), hs.wait().reshape(-1)), (src, sent))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received, None, ctx.process_set))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set: ProcessSet = global_process_set):
    """Send splits[j] rows to rank j. Returns the rows received, or (rows, received_splits) when splits is given."""
    return _Alltoall.apply(tensor, splits, name, process_set)


# -- reducescatter ----------------------------------------------------------------

def _reducescatter_start(tensors, name, op, process_set, prescale_factor, postscale_factor, what) -> int:
    """Start a reduce-scatter of each tensor of `tensors` (one submission each, queued together);
    the handle's result is the list of this rank's parts."""
    op = _resolve_op(None, op, what)
    if op not in (Sum, Average, Min, Max):
        raise ValueError(f"pycomm.horovod.{what}: op=hvd.{_OP_NAMES[op]} is not supported; use Average, "
                         "Sum, Min or Max")
    _check_scales(op, prescale_factor, postscale_factor, what)
    group = _group(process_set, what)
    n = _set_size(process_set)
    handles, posts, srcs = [], [], []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"pycomm.horovod.{what}: expected a torch.Tensor, got {type(tensor).__name__}")
        t_op, post = _average_rule(op, tensor.dtype, n)
        src = tensor.detach()
        if prescale_factor != 1.0:
            src = _scaled(src, prescale_factor)
        src = src.contiguous()
        sub = None if not name else (name if len(tensors) == 1 else f"{name}.{i}")
        handles.append(pycomm.reduce_scatter_async(src, op=_PYCOMM_OP[t_op], name=sub, group=group))
        posts.append(post)
        srcs.append(src)

    def finish():
        outs = []
        for h, post in zip(handles, posts):
            out = h.wait()
            _postscale_(out, postscale_factor, post)
            outs.append(out)
        return outs

    return _register(handles, finish, srcs)


def reducescatter_async(tensor, name=None, op=Average, process_set: ProcessSet = global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start a reduce-scatter: rank r gets the reduction of rows part r (torch.tensor_split's cut)."""
    h = _named(name, "reducescatter_async", lambda: _reducescatter_start(
        [tensor], name, op, process_set, prescale_factor, postscale_factor, "reducescatter"))
    handles, finish, keep = _handle_map[h]
    _handle_map[h] = (handles, lambda: finish()[0], keep)
    return h


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set: ProcessSet = global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start a reduce-scatter of every tensor of the list; synchronize returns the list of parts."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"pycomm.horovod.grouped_reducescatter: expected a list of tensors, got "
                        f"{type(tensors).__name__}")
    return _reducescatter_start(list(tensors), name, op, process_set, prescale_factor, postscale_factor,
                                "grouped_reducescatter")


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op, ctx.process_set, ctx.pre, ctx.post = op, process_set, prescale_factor, postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.op not in (Sum, Average):
            raise RuntimeError(f"pycomm.horovod.reducescatter: no gradient for op=hvd.{_OP_NAMES[ctx.op]}")
        grad = synchronize(allgather_async(grad_output.contiguous(), None, ctx.process_set))
        # Horovod's gradient of a reducescatter: the allgather of the output gradients, times the set's
        # size for Sum (times 1 for Average), times the scale factors -- as its allreduce gradient sums
        # over the ranks (docs/compatibility.md).
        scale = ctx.pre * ctx.post * (_set_size(ctx.process_set) if ctx.op == Sum else 1)
        return grad * scale if scale != 1 else grad, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set: ProcessSet = global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over the set, scatter along dim 0 (default Average); differentiable."""
    if _is_onebit(compression):
        raise ValueError("pycomm.horovod.reducescatter: Compression.onebit applies to allreduce only")
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set: ProcessSet = global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """reducescatter of every tensor of the list (queued together); differentiable; returns a list."""
    if _is_onebit(compression):
        raise ValueError("pycomm.horovod.grouped_reducescatter: Compression.onebit applies to allreduce only")
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"pycomm.horovod.grouped_reducescatter: expected a list of tensors, got "
                        f"{type(tensors).__name__}")
    if compression is Compression.none and not any(isinstance(t, torch.Tensor) and t.requires_grad
                                                   for t in tensors):
        return synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                       postscale_factor))
    return [reducescatter(t, f"{name}.{i}" if name else None, compression, op, process_set, prescale_factor,
                          postscale_factor) for i, t in enumerate(tensors)]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    pycomm.barrier(group=_group(process_set, "barrier"))
