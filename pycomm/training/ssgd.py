"""SSGD: synchronous SGD, w <- w - eta * avg_k g_k(w) (docs/algorithms.md §4).

Equal to one minibatch of N*b samples. Gradients are averaged by
DistributedOptimizer while backward runs (bucketed, overlapped); the sync
point is inside ``DistributedOptimizer.step()`` and happens every step.
An optimizer that is the whole data-parallel step by itself
(``reduces_gradients = True``: pycomm.optim.OneBitAdam, OneBitLAMB) is
used as it is, without DistributedOptimizer; its sync point is its step().
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

from ..optimizer import DistributedOptimizer, check_compression
from .base import Algorithm


@dataclass
class SSGDConfig:
    """compression: gradient compression (pycomm.optimizer.SUPPORTED_COMPRESSION).
    backward_passes_per_step: local gradient accumulation before each reduction.
    bucket_mb: gradient bucket size in MiB (Horovod/DDP use 25-64)."""
    compression: str = "none"
    backward_passes_per_step: int = 1
    bucket_mb: float = 25.0

    def __post_init__(self):
        check_compression(self.compression)
        if self.backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {self.backward_passes_per_step}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")


class SSGD(Algorithm):
    name = "ssgd"
    elastic_supported = True
    Config = SSGDConfig

    def __init__(self, model, local_optimizer, config: SSGDConfig = None):
        super().__init__(model, local_optimizer, config)
        c = self.config
        self.self_reducing = bool(getattr(local_optimizer, "reduces_gradients", False))
        if self.self_reducing:
            if c.compression != "none":
                raise ValueError(f"ssgd: {type(local_optimizer).__name__} compresses by itself; "
                                 f"compression={c.compression!r} does not apply")
            self.optimizer = local_optimizer
            self._passes = 0
            self._sent_base = self._reduced_base = 0
            return
        self.optimizer = DistributedOptimizer(local_optimizer, model.named_parameters(), compression=c.compression,
                                              backward_passes_per_step=c.backward_passes_per_step,
                                              bucket_mb=c.bucket_mb)
        self._passes = 0
        self._sent_base = self._reduced_base = 0  # counters carried over from a loaded state

    def step(self) -> None:
        self._passes += 1
        if self._passes < self.config.backward_passes_per_step:
            return  # accumulate locally
        self._passes = 0
        # ---- sync point: DistributedOptimizer waits for the gradient allreduces ----
        # (they started during backward, from the gradient hooks)
        self.optimizer.step()
        self.bytes_sent = self._sent_base + self.optimizer.bytes_sent
        if self.self_reducing:  # payload: the float32 gradient (warm-up) or momentum (compressed) of every parameter
            self.bytes_reduced += 4 * sum(p.numel() for p in self.params)
        else:
            self.bytes_reduced = self._reduced_base + self.optimizer.bytes_reduced
        self.num_syncs += 1
        self.steps += 1

    def zero_grad(self) -> None:
        if self._passes == 0:
            self.optimizer.zero_grad(set_to_none=True)

    def sync(self) -> None:
        """SSGD synchronizes inside every step; nothing is ever pending."""

    def extra_state(self) -> Dict[str, Any]:
        return {"passes": self._passes, "compression": self.optimizer.compressor.state_dict()}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        self._passes = int(state["passes"])
        if "compression" in state:  # error-feedback residuals (onebit)
            self.optimizer.compressor.load_state_dict(state["compression"])
        self._sent_base = self.bytes_sent - self.optimizer.bytes_sent
        if self.self_reducing:  # its residuals came with the local optimizer's state_dict
            return
        self._reduced_base = self.bytes_reduced - self.optimizer.bytes_reduced
        self.optimizer._alias()  # the local optimizer's load_state_dict replaced its state dict
