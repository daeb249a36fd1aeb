"""Hogwild!: lock-free updates of one shared-memory model by the ranks of a node (Recht et al. 2011;
docs/algorithms.md §5).

Node-local rank 0 allocates an MPI-3 shared window (MPI_Win_allocate_shared
on pycomm's node communicator) holding every trainable parameter; every rank
then points its parameters' storage at that memory. Each rank's local
optimizer updates the shared parameters in place, without locks and without
any message: w <- w - eta g_k lands in the one model all ranks read. Updates
of different ranks to the same element may race (Hogwild's premise: sparse
updates rarely collide); updates to disjoint elements all land: a step adds
only the elements it changed (see step). Optimizer state (e.g. momentum)
stays per rank. One node only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..runtime import local_comm, topology
from .base import Algorithm

_NP = {torch.float32: np.float32, torch.float64: np.float64}


@dataclass
class HogwildConfig:
    """No options: every step is the local optimizer's step on the shared model."""


class Hogwild(Algorithm):
    name = "hogwild"
    Config = HogwildConfig

    def __init__(self, model, local_optimizer, config: HogwildConfig = None):
        super().__init__(model, local_optimizer, config)
        topo = topology()
        if topo.num_nodes != 1:
            raise ValueError(f"hogwild shares one model in the memory of one node; this job spans {topo.num_nodes} "
                             "nodes (or virtual nodes: unset PYCOMM_RANKS_PER_NODE)")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1 or (dtypes and next(iter(dtypes)) not in _NP):
            raise TypeError(f"hogwild: the shared model holds one float32 or float64 buffer; parameters have "
                            f"{sorted(str(d) for d in dtypes)}")
        from mpi4py import MPI

        dtype = next(iter(dtypes)) if dtypes else torch.float32
        item = torch.empty(0, dtype=dtype).element_size()
        total = sum(p.numel() for p in self.params)
        comm = local_comm()
        self._comm = comm
        self._win = MPI.Win.Allocate_shared(total * item if comm.rank == 0 else 0, item, comm=comm)
        buf, _ = self._win.Shared_query(0)
        flat = torch.from_numpy(np.frombuffer(buf, dtype=_NP[dtype], count=total))
        with torch.no_grad():
            off = 0
            views = []
            for p in self.params:
                n = p.numel()
                views.append(flat[off:off + n].view_as(p))
                off += n
            if comm.rank == 0:
                for v, p in zip(views, self.params):
                    v.copy_(p.data)
            comm.Barrier()
            for v, p in zip(views, self.params):
                p.data = v  # the parameter now lives in the shared window
        self._flat = flat

    def step(self) -> None:
        # The local optimizer steps a private copy; only the elements it changed are then added to the
        # shared model, as deltas (w_e <- w_e + (w'_e - w_e) for the e it touched, Hogwild's component-wise
        # update). A dense in-place step would also write back every untouched element, and such a write
        # can undo another rank's update to it that landed between the read and the write: the updates
        # of disjoint elements were then lost now and then (seen in test_hogwild_updates_of_every_rank_land).
        with torch.no_grad():
            snapshots = [p.data.clone() for p in self.params]
            shared = [p.data for p in self.params]
            for p, snap in zip(self.params, snapshots):
                p.data = snap.clone()
        try:
            self.local_optimizer.step()
        finally:
            with torch.no_grad():
                for p, snap, mem in zip(self.params, snapshots, shared):
                    delta = p.data - snap
                    touched = delta != 0
                    mem[touched] += delta[touched]
                    p.data = mem  # the parameter lives in the shared window again
        self.steps += 1

    def sync(self) -> None:
        """Nothing to synchronize: every update is already in the shared model."""

    def finalize(self) -> None:
        self._comm.Barrier()  # every rank's last update is written before anyone evaluates
