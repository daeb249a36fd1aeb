"""BMUF: blockwise model-update filtering (Chen & Huo, ICASSP 2016), classic (CBM) and Nesterov (NBM).

Block t starts every rank from W_g(t-1); each runs tau local steps to W_k(t);
at the sync point (docs/algorithms.md §4)::

    W_bar(t) = avg_k W_k(t)
    G(t)     = W_bar(t) - W_g(t-1)          # the mean over ranks, not the sum
    Delta(t) = block_momentum * Delta(t-1) + block_lr * G(t)
    W(t)     = W(t-1) + Delta(t)
    W_g(t)   = W(t)                               (CBM)
    W_g(t)   = W(t) + block_momentum * Delta(t)   (NBM, nesterov=True)

and every rank continues from W_g(t). With block_momentum 0 and block_lr 1
this is model averaging.

Local optimizer state at a sync:
- SGD/RMSprop ``momentum_buffer``: zeroed when ``reset_local_momentum`` (CNTK), else kept.
- Adam/RAdam moments (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), i.e.
  BMUF-Adam (Chen, Ding, Huo, ICASSP 2020): ``moment_sync`` = ``average``
  (allreduced with the model in the same buffer, fairseq's average_sync),
  ``keep`` (left local) or ``reset`` (zeroed). Adam's step counter is never
  reset: it counts all local steps, the same on every rank.
- Other state (Adagrad sums, RMSprop/Adadelta averages) stays local.

Warm-up: the first ``warmup_steps`` steps are plain SSGD (gradients averaged
every step); blocks start after them, from the common model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .base import Algorithm, clone_tensors

MOMENT_SYNC = ("average", "keep", "reset")
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@dataclass
class BMUFConfig:
    """sync_period (tau): local steps per block [50, fairseq].
    block_momentum: [None = 1 - 1/N]. block_lr: [1].
    nesterov: NBM instead of CBM [True].
    reset_local_momentum: zero the local SGD momentum after each sync [True, CNTK].
    warmup_steps: plain SSGD steps before the first block [500, fairseq].
    moment_sync: Adam moments at a sync, average | keep | reset [average]."""
    sync_period: int = 50
    block_momentum: Optional[float] = None
    block_lr: float = 1.0
    nesterov: bool = True
    reset_local_momentum: bool = True
    warmup_steps: int = 500
    moment_sync: str = "average"

    def __post_init__(self):
        if self.sync_period < 1:
            raise ValueError(f"sync_period must be >= 1, got {self.sync_period}")
        if self.block_momentum is not None and not 0.0 <= self.block_momentum < 1.0:
            raise ValueError(f"block_momentum must be in [0, 1), got {self.block_momentum}")
        if not self.block_lr > 0:
            raise ValueError(f"block_lr must be positive, got {self.block_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.moment_sync not in MOMENT_SYNC:
            raise ValueError(f"unknown moment_sync {self.moment_sync!r}; choose one of {', '.join(MOMENT_SYNC)}")


class BMUF(Algorithm):
    name = "bmuf"
    elastic_supported = True
    Config = BMUFConfig

    def __init__(self, model, local_optimizer, config: BMUFConfig = None):
        super().__init__(model, local_optimizer, config)
        c = self.config
        self.block_momentum = (1.0 - 1.0 / self.world_size) if c.block_momentum is None else c.block_momentum
        self.blocks = 0
        self.global_params: Optional[List[torch.Tensor]] = None  # W(t)
        self.start_params: Optional[List[torch.Tensor]] = None   # W_g(t)
        self.delta: Optional[List[torch.Tensor]] = None          # Delta(t)
        if c.warmup_steps == 0:
            self._start_blocks()

    @property
    def in_warmup(self) -> bool:
        return self.global_params is None

    def _start_blocks(self) -> None:
        self.global_params = clone_tensors(self.params)
        self.start_params = clone_tensors(self.params)
        self.delta = [torch.zeros_like(p) for p in self.params]

    def step(self) -> None:
        c = self.config
        if self.in_warmup:
            # ---- sync point (warm-up): SSGD, g <- avg_k g_k ----
            self.average_gradients_()
            self.num_syncs += 1
            self.local_optimizer.step()
            self.steps += 1
            if self.steps >= c.warmup_steps:
                self._start_blocks()
            return
        self.local_optimizer.step()
        self.steps += 1
        if (self.steps - c.warmup_steps) % c.sync_period == 0:
            self.sync()

    def _moments(self) -> List[torch.Tensor]:
        return self.optimizer_state_tensors(ADAM_MOMENTS)

    def sync(self) -> None:
        """Block update; a no-op during warm-up (SSGD keeps every rank equal)."""
        if self.in_warmup:
            return
        c = self.config
        moments = self._moments()
        # ---- sync point: W_bar = avg_k W_k (and Adam moments if moment_sync == average) ----
        shared = list(self.params) + (moments if c.moment_sync == "average" else [])
        self.average_(shared, "block")
        self.num_syncs += 1
        self.blocks += 1
        with torch.no_grad():
            for p, w, wg, d in zip(self.params, self.global_params, self.start_params, self.delta):
                g = p.detach() - wg                                  # G(t) = W_bar(t) - W_g(t-1)
                d.mul_(self.block_momentum).add_(g, alpha=c.block_lr)  # Delta(t)
                w.add_(d)                                             # W(t) = W(t-1) + Delta(t)
                wg.copy_(w)
                if c.nesterov:
                    wg.add_(d, alpha=self.block_momentum)             # W_g(t) = W(t) + bm * Delta(t)
                p.copy_(wg)
            if c.moment_sync == "reset":
                for m in moments:
                    m.zero_()
            if c.reset_local_momentum:
                for m in self.optimizer_state_tensors(("momentum_buffer",)):
                    m.zero_()

    def finalize(self) -> None:
        if not self.in_warmup and (self.steps - self.config.warmup_steps) % self.config.sync_period != 0:
            self.sync()

    def eval_parameters(self):
        return self.params if self.in_warmup else self.global_params

    def extra_state(self) -> Dict[str, Any]:
        return {
            "blocks": self.blocks,
            "block_momentum": self.block_momentum,
            "global_params": None if self.in_warmup else clone_tensors(self.global_params),
            "start_params": None if self.in_warmup else clone_tensors(self.start_params),
            "delta": None if self.in_warmup else clone_tensors(self.delta),
        }

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        self.blocks = int(state["blocks"])
        self.block_momentum = float(state["block_momentum"])
        if state["global_params"] is None:
            self.global_params = self.start_params = self.delta = None
        else:
            self.global_params = clone_tensors(state["global_params"])
            self.start_params = clone_tensors(state["start_params"])
            self.delta = clone_tensors(state["delta"])
