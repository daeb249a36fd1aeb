"""pycomm: an MPI-driven communication backend for distributed deep learning with PyTorch.

    import pycomm
    pycomm.init()
    pycomm.allreduce(tensor, op="avg")

Launch with ``pycomm-run -np 4 python train.py`` (a thin wrapper over mpirun).
"""
import torch  # noqa: F401  (loads libtorch before the native core)

from . import _C
from . import kernels
from . import compression
from . import compressors  # registers powersgd, topk and threshold in compression's registry
from .collectives import (
    Handle,
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    broadcast_async,
    resolve_algorithm,
)
from .collectives import alltoall, alltoall_async, reduce_scatter, reduce_scatter_async
from .collectives import GroupHandle, HandleList, grouped_allreduce, grouped_allreduce_async
from .groups import ProcessGroup, destroy_group, new_group
from .join import join
from .timeline import start_timeline, stop_timeline, timeline_path
from .optimizer import (
    SUPPORTED_COMPRESSION,
    DistributedOptimizer,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .runtime import (
    CommError,
    RanksFailedError,
    Topology,
    cross_comm,
    get_options,
    init,
    is_initialized,
    local_comm,
    local_rank,
    local_size,
    node_rank,
    num_nodes,
    rank,
    set_options,
    shutdown,
    size,
    stats,
    topology,
    world_comm,
)

from . import training  # noqa: E402  (after the collectives it uses)

__version__ = "0.1.0"
cuda_built = bool(_C.cuda_built)

__all__ = [
    "CommError", "RanksFailedError", "DistributedOptimizer", "Handle", "SUPPORTED_COMPRESSION", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "Topology", "allgather", "allgather_async", "allreduce", "allreduce_async",
    "barrier", "broadcast", "broadcast_async", "cross_comm", "cuda_built", "get_options", "init",
    "is_initialized", "local_comm", "local_rank", "local_size", "node_rank", "num_nodes", "rank",
    "resolve_algorithm", "set_options", "shutdown", "size", "stats", "topology", "training", "world_comm",
]
__all__ += ["join", "start_timeline", "stop_timeline", "timeline_path"]
__all__ += ["GroupHandle", "HandleList", "grouped_allreduce", "grouped_allreduce_async"]
__all__ += ["ProcessGroup", "alltoall", "alltoall_async", "destroy_group", "new_group", "reduce_scatter",
            "reduce_scatter_async"]


def __getattr__(name):
    # PEP 562: `pycomm.algorithms` without importing it worked while the package was imported eagerly
    # under that name. Warning here, at the caller's line, keeps `import pycomm` itself silent; caching
    # the answer makes it one warning, also for `from pycomm import algorithms` (which looks it up twice).
    if name == "algorithms":
        import warnings
        warnings.warn("pycomm.algorithms is deprecated and will be removed in the next release; "
                      "import pycomm.training instead", DeprecationWarning, stacklevel=2)
        globals()["algorithms"] = training
        return training
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
