"""EASGD: elastic averaging SGD, synchronous, period tau (Zhang, Choromanska, LeCun 2015; docs/algorithms.md §4).

Every tau local steps, with x_c the centre variable (identical on every rank)::

    x_k <- x_k - alpha (x_k - x_c)
    x_c <- (1 - beta) x_c + beta avg_k x_k        (x_k before its elastic update)

beta = N alpha couples the two moves symmetrically; the default takes
beta = 0.9 (the paper's choice) and alpha = beta / N. The centre is the
model that is evaluated and kept at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from .base import Algorithm, clone_tensors


@dataclass
class EASGDConfig:
    """sync_period (tau): local steps between elastic updates [10; the paper varies it].
    beta: moving rate of the centre [0.9]. alpha: elastic pull on each worker [None = beta / N]."""
    sync_period: int = 10
    beta: float = 0.9
    alpha: Optional[float] = None

    def __post_init__(self):
        if self.sync_period < 1:
            raise ValueError(f"sync_period must be >= 1, got {self.sync_period}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")


class EASGD(Algorithm):
    name = "easgd"
    Config = EASGDConfig

    def __init__(self, model, local_optimizer, config: EASGDConfig = None):
        super().__init__(model, local_optimizer, config)
        self.alpha = self.config.beta / self.world_size if self.config.alpha is None else self.config.alpha
        self.center = clone_tensors(self.params)  # x_c

    def step(self) -> None:
        self.local_optimizer.step()
        self.steps += 1
        if self.steps % self.config.sync_period == 0:
            self.sync()

    def sync(self) -> None:
        beta = self.config.beta
        avg = clone_tensors(self.params)
        # ---- sync point: avg_k x_k ----
        self.average_(avg, "model")
        self.num_syncs += 1
        with torch.no_grad():
            for p, c, a in zip(self.params, self.center, avg):
                p.sub_(p.detach() - c, alpha=self.alpha)   # x_k <- x_k - alpha (x_k - x_c)
                c.mul_(1.0 - beta).add_(a, alpha=beta)      # x_c <- (1 - beta) x_c + beta avg_k x_k

    def finalize(self) -> None:
        if self.steps % self.config.sync_period != 0:
            self.sync()

    def eval_parameters(self):
        return self.center

    def extra_state(self) -> Dict[str, Any]:
        return {"center": clone_tensors(self.center), "alpha": self.alpha}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        self.alpha = float(state["alpha"])
        for c, s in zip(self.center, state["center"]):
            c.copy_(s)
