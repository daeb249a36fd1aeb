"""EC-DNN: ensemble-compression (Sun et al. 2017; docs/algorithms.md §5b).

Every rank trains its own model on its own data. Every ``sync_period`` (tau)
local steps the ranks exchange their models (one allgather of the flattened
parameters): each rank then holds all N models, the ensemble

    E(x) = 1/N sum_k softmax(f_k(x) / T)

(the average of the models' outputs, not of their parameters). The ensemble
is N times the model; it is compressed back into one model of the original
size by distillation on each rank's local data: for the next
``distill_steps`` local steps each rank minimizes

    (1 - lambda) CE(f(x), y) + lambda T^2 CE(softmax(f(x) / T), E(x))

starting from its own current model (the student), with the ensemble's
outputs on the same minibatch as soft targets and the hard-label loss beside
them. The compressed model continues as the rank's local model; after the
distillation steps it trains on the hard labels alone until the next
exchange.

Choices the paper leaves open here (docs/seeds-methods.md): the ensemble
averages probabilities at temperature T [1]; lambda [0.5]; the compression
runs during the next round's local steps, on the minibatches that come
(``distill_steps`` [None = tau]), so it costs N forward passes of the
teachers per step and no extra pass over the data; the student starts from
the rank's own model. Only trainable parameters travel; buffers stay local.
The model evaluated (``eval_parameters``) is rank 0's model as of the last
exchange (every rank holds it after the allgather, so no communication):
one model of the original size, the "local" EC-DNN model. ``ensemble_model()``
gives the ensemble itself.

Communication per exchange: an allgather of the float32 parameters, S bytes
per rank: each rank sends (N - 1) S bytes with a ring (counted in
``bytes_sent``); model averaging sends 2 (N - 1)/N S per sync, so EC-DNN at
sync period N/2 tau sends what model averaging sends at tau.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from .. import collectives
from .base import Algorithm, clone_tensors, trainable_parameters


@dataclass
class ECDNNConfig:
    """sync_period (tau): local steps between ensembles [50, as model averaging].
    distill_weight (lambda): weight of the soft-target loss [0.5].
    temperature (T): softmax temperature of the ensemble and the student [1.0].
    distill_steps: local steps after an ensemble that use its soft targets [None = tau]."""
    sync_period: int = 50
    distill_weight: float = 0.5
    temperature: float = 1.0
    distill_steps: Optional[int] = None

    def __post_init__(self):
        if self.sync_period < 1:
            raise ValueError(f"sync_period must be >= 1, got {self.sync_period}")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.distill_steps is not None and self.distill_steps < 0:
            raise ValueError(f"distill_steps must be >= 0, got {self.distill_steps}")


class _Ensemble(torch.nn.Module):
    """The average of the members' softmax outputs (temperature T)."""

    def __init__(self, members: List[torch.nn.Module], temperature: float):
        super().__init__()
        self.members = torch.nn.ModuleList(members)
        self.temperature = temperature

    def forward(self, x):
        probs = [F.softmax(m(x) / self.temperature, dim=-1) for m in self.members]
        return torch.stack(probs).mean(0)


class ECDNN(Algorithm):
    name = "ec_dnn"
    Config = ECDNNConfig

    def __init__(self, model, local_optimizer, config: ECDNNConfig = None):
        super().__init__(model, local_optimizer, config)
        self._distill_left = 0  # local steps that still use the current ensemble's soft targets
        self._teachers: Optional[List[List[torch.Tensor]]] = None  # every rank's parameters at the last exchange
        self._ensemble: Optional[_Ensemble] = None
        self.eval_params = clone_tensors(self.params)  # rank 0's model at the last exchange (the start: the same)

    @property
    def distill_steps(self) -> int:
        c = self.config
        return c.sync_period if c.distill_steps is None else c.distill_steps

    # -- the loss the training loop minimizes ----------------------------------
    def training_loss(self, output: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """CE(output, y), or while distilling (1 - lambda) CE + lambda T^2 CE(softmax(output / T), E(x))."""
        hard = F.cross_entropy(output, y)
        if self._distill_left <= 0 or self._ensemble is None:
            return hard
        c = self.config
        with torch.no_grad():
            soft_targets = self._ensemble(x)
        t = c.temperature
        soft = -(soft_targets * F.log_softmax(output / t, dim=-1)).sum(-1).mean() * (t * t)
        return (1.0 - c.distill_weight) * hard + c.distill_weight * soft

    def step(self) -> None:
        self.local_optimizer.step()
        self.steps += 1
        if self._distill_left > 0:
            self._distill_left -= 1
        if self.steps % self.config.sync_period == 0:
            self.sync()

    def sync(self) -> None:
        # ---- exchange point: every rank gets every rank's model (ring allgather, (N - 1) S bytes sent) ----
        with torch.no_grad():
            groups: Dict[torch.dtype, List[int]] = {}
            for i, p in enumerate(self.params):
                groups.setdefault(p.dtype, []).append(i)
            gathered: List[List[Optional[torch.Tensor]]] = [[None] * len(self.params) for _ in range(self.world_size)]
            for dtype, idx in groups.items():
                flat = torch.cat([self.params[i].detach().reshape(-1) for i in idx])
                if flat.numel() == 0:
                    continue
                allg = collectives.allgather(flat, name=f"{self.name}.models").view(self.world_size, -1)
                nbytes = flat.numel() * flat.element_size()
                self.bytes_reduced += nbytes
                self.bytes_sent += (self.world_size - 1) * nbytes
                for k in range(self.world_size):
                    off = 0
                    for i in idx:
                        n = self.params[i].numel()
                        gathered[k][i] = allg[k, off:off + n].view_as(self.params[i]).clone()
                        off += n
            for k in range(self.world_size):  # empty parameters (not gathered) are themselves
                for i, p in enumerate(self.params):
                    if gathered[k][i] is None:
                        gathered[k][i] = p.detach().clone()
        self.num_syncs += 1
        self._set_teachers(gathered)
        self._distill_left = self.distill_steps

    def _set_teachers(self, gathered: List[List[torch.Tensor]]) -> None:
        self._teachers = gathered
        members = []
        for params in gathered:
            m = copy.deepcopy(self.model)
            m.eval()
            with torch.no_grad():
                for dst, src in zip(trainable_parameters(m), params):
                    dst.copy_(src)
                    dst.requires_grad_(False)
            members.append(m)
        self._ensemble = _Ensemble(members, self.config.temperature)
        with torch.no_grad():
            for dst, src in zip(self.eval_params, gathered[0]):
                dst.copy_(src)

    def finalize(self) -> None:
        if self.steps % self.config.sync_period != 0:
            self.sync()

    def eval_parameters(self):
        return self.eval_params

    def ensemble_model(self) -> Optional[torch.nn.Module]:
        """The ensemble of the last exchange (average of the N models' probabilities), or None before it."""
        return self._ensemble

    def extra_state(self) -> Dict[str, Any]:
        return {"distill_left": self._distill_left,
                "teachers": None if self._teachers is None else [clone_tensors(t) for t in self._teachers],
                "eval_params": clone_tensors(self.eval_params)}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        self._distill_left = int(state["distill_left"])
        if state["teachers"] is not None:
            self._set_teachers([clone_tensors(t) for t in state["teachers"]])
        else:
            self._teachers, self._ensemble = None, None
        for g, s in zip(self.eval_params, state["eval_params"]):
            g.copy_(s)
