"""What the parameter-server algorithms share (docs/algorithms.md §5): asgd, ssp, dcasgd, adadelay.

Every rank is a worker and serves one shard of every parameter (co-located
servers, pycomm.ps), or, under ``pycomm-run --servers K`` (PYCOMM_PS_SERVERS),
the last K ranks only serve (``is_server_only``: the training loop calls
``serve()`` there) and the others train. Per step a worker pushes its
gradients; the servers apply the update rule in C++ as each push arrives,
and the worker pulls the current weights (SSP: after its clock is granted,
read in the same instant).
The local optimizer must be torch.optim.SGD: its lr, momentum and
weight_decay become the servers' rule (the worker takes no local step).
``eval_parameters()`` is the model this worker last pulled; ``finalize()``
waits for every worker, pulls the final model (the same on every rank),
records the staleness statistics and shuts the servers down.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..ps import ParameterServer, TurnSchedule, UpdateRule, servers_from_env
from .base import Algorithm


class PSAlgorithm(Algorithm):
    def __init__(self, model, local_optimizer, config=None):
        super().__init__(model, local_optimizer, config)
        opt = local_optimizer
        if type(opt) is not torch.optim.SGD:
            raise TypeError(f"{self.name}: the servers apply SGD; pass torch.optim.SGD as the local optimizer "
                            f"(its lr, momentum and weight_decay configure them), got {type(opt).__name__}")
        g = opt.param_groups
        if len(g) != 1:
            raise ValueError(f"{self.name}: one parameter group expected (the servers use one rule), got {len(g)}")
        g = g[0]
        if g.get("nesterov") or g.get("dampening", 0) != 0 or g.get("maximize"):
            raise ValueError(f"{self.name}: the servers' SGD has no nesterov, dampening or maximize; got "
                             f"nesterov={g.get('nesterov')}, dampening={g.get('dampening')}")
        bad = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32]
        if bad:
            raise TypeError(f"{self.name}: the parameter server holds float32; parameters {bad} are not")
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.ps = self.create_ps(self.make_rule(float(g["lr"]), float(g["momentum"]), float(g["weight_decay"])))
        if self.ps.is_worker:
            self.ps.register(list(zip(self.names, [p.data for p in self.params])))
        self.schedule: Optional[TurnSchedule] = None
        self.final_stats: Optional[dict] = None
        self._zeros: Dict[str, torch.Tensor] = {}

    # -- what the subclasses choose ---------------------------------------------
    def make_rule(self, lr: float, momentum: float, weight_decay: float) -> UpdateRule:
        return UpdateRule(lr=lr, momentum=momentum, weight_decay=weight_decay)

    def create_ps(self, rule: UpdateRule) -> ParameterServer:
        return ParameterServer(rule, servers=servers_from_env(), staleness_bound=self.staleness_bound(),
                               stall_report_s=self.config.stall_report_s)

    @property
    def is_server_only(self) -> bool:
        """A dedicated server rank: it trains nothing; serve() until the workers finish."""
        return not self.ps.is_worker

    def serve(self) -> None:
        """Dedicated server ranks: serve until every worker has finalized."""
        self.ps.serve()

    def staleness_bound(self) -> Optional[int]:
        return None

    # -- the training-loop contract ---------------------------------------------
    def set_schedule(self, order: Sequence[int]) -> None:
        """Deterministic mode: step i of the job belongs to worker order[i] (pycomm.ps.TurnSchedule)."""
        self.schedule = TurnSchedule(self.ps, order)

    def _grads(self) -> List[torch.Tensor]:
        out = []
        for n, p in zip(self.names, self.params):
            if p.grad is None:  # unused this step: a zero gradient still advances the versions
                if n not in self._zeros:
                    self._zeros[n] = torch.zeros_like(p.data)
                out.append(self._zeros[n])
            else:
                out.append(p.grad.detach().contiguous())
        return out

    def step(self) -> None:
        turn = self.schedule.turn() if self.schedule is not None else contextlib.nullcontext()
        grads = self._grads()
        with turn:
            self.exchange(grads)
        self.steps += 1
        self.num_syncs += 1
        self.bytes_sent = self.bytes_reduced = self.ps.bytes_pushed

    def exchange(self, grads: List[torch.Tensor]) -> None:
        """Push this step's gradients and pull the weights back: each tensor's push and pull travel as
        one request (push_pull), so the weights come back with this gradient applied."""
        hs = [self.ps.push_pull_async(n, g, p.data) for n, g, p in zip(self.names, grads, self.params)]
        for h in hs:
            h.wait()

    def pull(self) -> None:
        """Fetch the current weights into the model (requests follow this worker's pushes)."""
        hs = [self.ps.pull_async(n, p.data) for n, p in zip(self.names, self.params)]
        for h in hs:
            h.wait()

    def sync(self) -> None:
        """Asynchronous: every step already pushed and pulled."""

    def finalize(self) -> None:
        if self.ps._closed:
            return
        self.ps.barrier()  # every worker's pushes applied
        hs = [self.ps.pull_async(n, p.data) for n, p in zip(self.names, self.params)]
        for h in hs:
            h.wait()
        self.final_stats = self.ps.stats()
        self.ps.shutdown()

    def staleness(self) -> dict:
        """Staleness statistics of the servers (pycomm.ps.ParameterServer.stats), final after finalize()."""
        return self.final_stats if self.final_stats is not None else self.ps.stats()

    def summary(self) -> Dict[str, Any]:
        st = self.staleness()
        return {"staleness_mean": round(st["mean_staleness"], 3), "staleness_max": st["max_staleness"],
                "staleness_histogram": [int(x) for x in torch.tensor(st["histogram"]).sum(0).tolist()]}

    # -- state --------------------------------------------------------------------
    def extra_state(self) -> Dict[str, Any]:
        pos = self.schedule.global_position() if self.schedule is not None else None
        return {"ps": self.ps.state_dict(), "schedule_pos": pos}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        self.ps.load_state_dict(state["ps"])
        if self.schedule is not None and state.get("schedule_pos") is not None:
            self.schedule.restart_at(int(state["schedule_pos"]))
