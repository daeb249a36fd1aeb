"""What this installation of pycomm was built with: ``pycomm-run --check-build``.

Runs in one process without a job: MPI is initialized as a singleton, the
engine is not started. The tune table shown is the one ``pycomm.init()`` would
load for the job shape given (``-np``, ``-H``/``--hostfile``,
``PYCOMM_RANKS_PER_NODE``).
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence


def job_shape(np: int, host_ranks: Optional[Sequence[int]]) -> "object":
    """The Topology (rank 0's view) of `np` ranks placed `host_ranks` per host (pycomm.tools.launcher's
    ranks_per_host, in host order), or on this host alone (None)."""
    from ..runtime import Topology, _env_int

    per_node = _env_int("PYCOMM_RANKS_PER_NODE", 0)
    if host_ranks:
        counts = list(host_ranks)
        virtual = False
    elif per_node > 0:
        counts = [min(per_node, np - start) for start in range(0, np, per_node)]
        virtual = True
    else:
        counts, virtual = [np], False
    return Topology(rank=0, size=np, local_rank=0, local_size=counts[0], node_rank=0, num_nodes=len(counts),
                    homogeneous=len(set(counts)) == 1, virtual_nodes=virtual)


def report(np: int, host_ranks: Optional[Sequence[int]], launcher: str, flavour: str) -> str:
    """The report of ``pycomm-run --check-build`` for `np` ranks placed `host_ranks` per host (None: this
    host alone), started by `launcher`, whose MPI is `flavour` (the launcher's detection)."""
    from ..runtime import mpi

    MPI = mpi()  # before pycomm._C, as everywhere
    import mpi4py
    import torch

    import pycomm
    from pycomm import _C, kernels
    from pycomm.tools import tune

    lines: List[str] = []

    def row(what: str, value: str) -> None:
        lines.append(f"{what:<18} {value}")

    row("pycomm", f"{pycomm.__version__} ({os.path.dirname(pycomm.__file__)})")
    row("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    row("CUDA kernels", f"{'built' if _C.cuda_built else 'not built'}; {cuda_devices} CUDA device(s) visible")
    aware = _C.mpi_cuda_aware()
    override = os.environ.get("PYCOMM_CUDA_AWARE")
    row("CUDA-aware MPI", ("yes" if aware else "no") + (f" (PYCOMM_CUDA_AWARE={override})" if override else
                                                         " (MPIX_Query_cuda_support)"))
    from ..runtime import device_path

    library = {1: "CUDA-aware", 0: "built without CUDA", -1: "cannot tell"}[_C.mpi_library_cuda_support()]
    path = device_path()
    row("device path", {"staged": "staged: CUDA tensors through pinned host memory (the MPI cannot read "
                                  "device memory; peer_path is off)",
                        "peer or staged": "peer or staged: the MPI cannot read device memory; allreduces inside a "
                                          "node go by peer reads through CUDA IPC where every local rank can map "
                                          "the others' memory (probed at the first CUDA allreduce, then said in "
                                          "pycomm.stats()['device_path']), else staged through pinned host memory",
                        "direct": "direct: CUDA tensors to MPI as they are (CUDA-aware MPI)"}.get(path, path) +
        f"; the MPI library says of itself: {library}")
    row("CPU ISA", f"{kernels.cpu_isa()} (PYCOMM_CPU_ISA overrides); OpenMP threads {kernels.cpu_threads()}")
    library = MPI.Get_library_version().strip().splitlines()[0]
    row("MPI library", f"{library}; MPI standard {'.'.join(map(str, MPI.Get_version()))}")
    row("mpi4py", f"{mpi4py.__version__}")
    row("launcher", f"{launcher} ({flavour})")
    topo = job_shape(np, host_ranks)
    path = tune.table_path(topo)
    table = tune.load_table(topo)
    shape = f"{topo.size} ranks, {topo.num_nodes} node(s) x {topo.local_size}" + (" (virtual)" if topo.virtual_nodes
                                                                                  else "")
    if table:
        used = f"{path} ({len(table)} rows)"
    elif os.path.exists(path):
        used = f"{path} is stale or for another shape: auto uses the built-in rule"
    else:
        used = f"none ({path} does not exist): auto uses the built-in rule"
    row("job shape", shape)
    row("tune table", used)
    return "\n".join(lines)
