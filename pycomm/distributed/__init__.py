"""pycomm as a torch.distributed backend.

    import pycomm.distributed            # registers backend "pycomm" for cpu and cuda
    import torch.distributed as dist
    dist.init_process_group("pycomm")    # under pycomm-run / mpirun: no MASTER_ADDR/PORT needed

Rank and world size come from MPI. torch's rendezvous still wants a store;
when MASTER_ADDR is unset, importing this module starts pycomm (MPI) and
sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE for torch's env://
rendezvous, agreed over MPI (rank 0 picks a free port on its host). Set them
yourself to use your own store. The collectives run in C++ on pycomm's engine
(csrc/c10d); see docs/backend.md.
"""
from __future__ import annotations

from .backend import BACKEND_NAME, bootstrap_env, register

register()
bootstrap_env()

__all__ = ["BACKEND_NAME", "bootstrap_env", "register"]
