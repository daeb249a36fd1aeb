"""Horovod's PyTorch API on pycomm: ``import pycomm.horovod as hvd``.

A script written for ``import horovod.torch as hvd`` runs unchanged with this
import line: the same functions, signatures, defaults and semantics
(allreduce out of place and averaging by default, ``root_rank``, integer
handles, ``hvd.DistributedOptimizer``, broadcasts of parameters and
optimizer state, process sets, SyncBatchNorm). Launch with ``pycomm-run``
(or plain ``mpirun``). The migration table in docs/horovod.md lists every name that
differs between Horovod, torch.distributed and pycomm's native API.

This package only uses pycomm's public API; pycomm never imports it.
"""
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    sparse_allreduce_async,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    rocm_built,
    shutdown,
    size,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm
from .extras import join, start_timeline, stop_timeline
from . import elastic  # hvd.elastic.run, TorchState, ElasticSampler (pycomm.elastic)

__all__ = [name for name in dir() if not name.startswith("_")]
