"""pycomm.join: uneven inputs, with Horovod's semantics (``hvd.join``).

A rank that has run out of batches calls ``join()``. Until every rank has
joined, its engine keeps taking part in what the other ranks still submit:
allreduces (any dtype and op, fused batches included) get the reduction's
identity from it -- zeros for sum and avg, +inf/-inf (or the integer limits)
for min/max, 1 for prod -- and an average divides by the ranks that
contributed, not by the job size; broadcasts from a rank that has not joined
are received and dropped; allgathers get no rows from it; barriers are
entered. Anything else submitted while a rank has joined (reduce_scatter,
alltoall, compressed allreduce, set_options, an allreduce of device memory,
a broadcast whose root has joined) raises pycomm.CommError on every rank,
naming the operation and the joined ranks; the joined ranks' ``join()``
raises the same error. ``join()`` returns, on every rank, the rank that joined
last (of several joining in the same coordination round, the highest).

The ranks that joined early did not take the last optimizer steps: broadcast
the model (and optimizer state) from the returned rank afterwards, or use
``DistributedOptimizer.join()``, which does both.
"""
from __future__ import annotations

from typing import Optional

from torch.autograd.profiler import record_function

from . import _C
from .groups import ProcessGroup, group_id
from .runtime import topology


def join(group: Optional[ProcessGroup] = None, answer_gathers: bool = True) -> int:
    """Answer the other ranks' operations until every rank has joined; returns the rank that joined last.

    group: a pycomm.new_group() group (default: all ranks); the returned rank is
    then the group rank. answer_gathers=False is Horovod's join: while this rank
    is joined, the others' allgathers and broadcasts raise CommError on the ranks
    that call them (this rank stays joined) instead of being answered.
    """
    topology()
    gid = group_id(group, "join")
    with record_function("pycomm.join"):
        return int(_C.join(gid, bool(answer_gathers)))
