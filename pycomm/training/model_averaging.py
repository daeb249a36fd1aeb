"""Model averaging (MA): tau local steps of any local optimizer, then w_k <- avg_k w_k (docs/algorithms.md §4).

Only the model is averaged; the local optimizer's state stays local.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

from .base import Algorithm, clone_tensors


@dataclass
class ModelAveragingConfig:
    """sync_period (tau): local steps between averages. The default, 50, is the
    BMUF period (fairseq), so that MA and BMUF compare at equal communication."""
    sync_period: int = 50

    def __post_init__(self):
        if self.sync_period < 1:
            raise ValueError(f"sync_period must be >= 1, got {self.sync_period}")


class ModelAveraging(Algorithm):
    name = "model_averaging"
    elastic_supported = True
    Config = ModelAveragingConfig

    def __init__(self, model, local_optimizer, config: ModelAveragingConfig = None):
        super().__init__(model, local_optimizer, config)
        self.global_params = clone_tensors(self.params)  # the model of the last average

    def step(self) -> None:
        self.local_optimizer.step()
        self.steps += 1
        if self.steps % self.config.sync_period == 0:
            self.sync()

    def sync(self) -> None:
        # ---- sync point: w_k <- avg_k w_k ----
        self.average_(self.params, "model")
        self.num_syncs += 1
        for g, p in zip(self.global_params, self.params):
            g.copy_(p.detach())

    def finalize(self) -> None:
        if self.steps % self.config.sync_period != 0:
            self.sync()

    def eval_parameters(self):
        return self.global_params

    def extra_state(self) -> Dict[str, Any]:
        return {"global_params": clone_tensors(self.global_params)}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        for g, s in zip(self.global_params, state["global_params"]):
            g.copy_(s)
