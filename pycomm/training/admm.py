"""Consensus ADMM with inexact local solves (docs/algorithms.md §4; Boyd et al. 2011 §7).

A round on rank k, with z the consensus model (identical on every rank)::

    lambda_k <- lambda_k + rho (w_k - z)
    w_k      <- approx. argmin_w l_k(w) + lambda_k^T (w - z) + rho/2 ||w - z||^2
                (local_steps steps of the local optimizer, each on one minibatch;
                 the gradient of the two penalty terms, lambda_k + rho (w - z),
                 is added to the minibatch gradient)
    z        <- avg_k (w_k + lambda_k / rho)

The round's first step applies the dual update; the last step ends with the
sync point. z is the model that is evaluated and kept at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch

from .base import Algorithm, clone_tensors


@dataclass
class ADMMConfig:
    """rho: penalty parameter [0.1]. local_steps: local optimizer steps per round, i.e. the sync
    period [10; not fixed by the sources].

    rho 0.1, not the 1.0 of Boyd et al.'s examples: it weighs the pull to z against the loss, and
    cross-entropy gradients of a network are small beside rho (w - z) at 1.0, which then holds every
    rank near z and slows training (digits, 4 ranks, 5 epochs: sgd 84.96% at 1.0, 91.36% at 0.1 and at
    0.01; adam 83.01 -> 87.5-88.6; lamb 82.17 -> 88.6-89.4; docs/training-defaults.md §6)."""
    rho: float = 0.1
    local_steps: int = 10

    def __post_init__(self):
        if not self.rho > 0:
            raise ValueError(f"rho must be positive, got {self.rho}")
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")


class ADMM(Algorithm):
    name = "admm"
    Config = ADMMConfig

    def __init__(self, model, local_optimizer, config: ADMMConfig = None):
        super().__init__(model, local_optimizer, config)
        self.z = clone_tensors(self.params)
        self.duals = [torch.zeros_like(p) for p in self.params]  # lambda_k
        self.rounds = 0

    def step(self) -> None:
        rho = self.config.rho
        with torch.no_grad():
            if self.steps % self.config.local_steps == 0:  # a round begins: dual update
                for lam, p, z in zip(self.duals, self.params, self.z):
                    lam.add_(p.detach() - z, alpha=rho)
            for lam, p, z in zip(self.duals, self.params, self.z):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.add_(lam).add_(p.detach() - z, alpha=rho)
        self.local_optimizer.step()
        self.steps += 1
        if self.steps % self.config.local_steps == 0:
            self.sync()

    def sync(self) -> None:
        rho = self.config.rho
        with torch.no_grad():
            for z, p, lam in zip(self.z, self.params, self.duals):
                z.copy_(p.detach()).add_(lam, alpha=1.0 / rho)   # w_k + lambda_k / rho
        # ---- sync point: z <- avg_k (w_k + lambda_k / rho) ----
        self.average_(self.z, "consensus")
        self.num_syncs += 1
        self.rounds += 1

    def finalize(self) -> None:
        if self.steps % self.config.local_steps != 0:
            self.sync()

    def eval_parameters(self):
        return self.z

    def extra_state(self) -> Dict[str, Any]:
        return {"z": clone_tensors(self.z), "duals": clone_tensors(self.duals), "rounds": self.rounds}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        for z, s in zip(self.z, state["z"]):
            z.copy_(s)
        for d, s in zip(self.duals, state["duals"]):
            d.copy_(s)
        self.rounds = int(state["rounds"])
