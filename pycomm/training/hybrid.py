"""Hybrid: synchronous SGD inside groups of ranks, asynchronous between groups (seed survey 6.3.2;
docs/algorithms.md §5).

Ranks form groups of ``group_size`` consecutive ranks (0: one group per node).
Per step the members of a group average their gradients (MPI Allreduce on the
group's communicator: SSGD inside the group); the group's first rank pushes the
average to the parameter server and pulls the weights, which it broadcasts to
its group. Groups never wait for each other: between groups the training is
ASGD, each group one worker of the servers. Servers are co-located on every
rank. Staleness counts server updates, i.e. other groups' pushes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch

from ..ps import ParameterServer, UpdateRule, servers_from_env
from ..runtime import topology, world_comm
from .asgd import check_stall
from .ps_algorithm import PSAlgorithm


@dataclass
class HybridConfig:
    """group_size: ranks per synchronous group (0: the ranks of a node; must divide the job's size).
    stall_report_s: a server names a group silent this long while others wait (0: never)."""
    group_size: int = 0
    stall_report_s: float = 60.0

    def __post_init__(self):
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 0:
            raise ValueError(f"group_size must be an integer >= 0 (0: one group per node), got {self.group_size!r}")
        check_stall(self.stall_report_s)


class Hybrid(PSAlgorithm):
    name = "hybrid"
    Config = HybridConfig

    def create_ps(self, rule: UpdateRule) -> ParameterServer:
        if servers_from_env():
            raise ValueError("hybrid: its groups' leaders use servers co-located on every rank; dedicated server "
                             f"ranks (PYCOMM_PS_SERVERS={servers_from_env()}, pycomm-run --servers) are for asgd, "
                             "ssp, dcasgd and adadelay. Run without --servers.")
        topo = topology()
        g = self.config.group_size or topo.local_size
        if topo.size % g:
            raise ValueError(f"hybrid: group_size {g} does not divide the job's {topo.size} ranks")
        if not self.config.group_size and not topo.homogeneous:
            raise ValueError("hybrid: nodes have different numbers of ranks; give group_size explicitly")
        self.group_size, self.group_index = g, topo.rank // g
        self.num_groups = topo.size // g
        self.group_comm = world_comm().Split(self.group_index, topo.rank)
        self.leader = self.group_comm.rank == 0
        return ParameterServer(rule, servers=0, stall_report_s=self.config.stall_report_s,
                               worker_ranks=[i * g for i in range(self.num_groups)])

    def _flat(self, tensors):
        return torch.cat([t.reshape(-1) for t in tensors])

    def _unflat(self, flat, tensors):
        off = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off:off + n].view_as(t))
            off += n

    def step(self) -> None:
        from mpi4py import MPI

        grads = self._flat(self._grads())
        if self.group_size > 1:  # SSGD inside the group: the mean gradient
            self.group_comm.Allreduce(MPI.IN_PLACE, grads.numpy(), op=MPI.SUM)
            grads /= self.group_size
        if self.leader:
            gs = []
            off = 0
            for p in self.params:
                gs.append(grads[off:off + p.numel()].view_as(p))
                off += p.numel()
            super_step = PSAlgorithm.step
            self._pending = gs
            super_step(self)  # push the group's gradient and pull (under the turn schedule if any)
        else:
            self.steps += 1
            self.num_syncs += 1
        self._bcast_model()

    def _grads(self):
        pending = getattr(self, "_pending", None)
        if pending is not None:
            self._pending = None
            return pending
        return super()._grads()

    def _bcast_model(self) -> None:
        if self.group_size == 1:
            return
        with torch.no_grad():
            flat = self._flat([p.data for p in self.params]).contiguous()
            self.group_comm.Bcast(flat.numpy(), root=0)
            self._unflat(flat, [p.data for p in self.params])

    def finalize(self) -> None:
        if self.ps._closed:
            return
        if self.leader:
            self.ps.barrier()
            hs = [self.ps.pull_async(n, p.data) for n, p in zip(self.names, self.params)]
            for h in hs:
                h.wait()
            self.final_stats = self.ps.stats()
        self._bcast_model()
        self.final_stats = self.group_comm.bcast(self.final_stats, root=0)
        self.ps.shutdown()

    def staleness(self) -> dict:
        if self.final_stats is not None:
            return self.final_stats
        return self.group_comm.bcast(self.ps.stats() if self.leader else None, root=0)

    def set_schedule(self, order) -> None:
        """Deterministic mode: turn i belongs to group order[i] (its leader takes it)."""
        if self.leader:
            super().set_schedule(order)

    def extra_state(self) -> Dict[str, Any]:
        return super().extra_state() if self.leader else {}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        if self.leader:
            super().load_extra_state(state)
