"""``pycomm-train --precision fp16|bf16``: SSGD through pycomm.optim.MixedPrecision.

The model runs forward and backward in the half type; the optimizer (any of
--optimizer) keeps float32 master weights; MixedPrecision agrees on overflow
across ranks (one int32 allreduce), averages the half gradients (one flat
allreduce in the half type; with onebit_adam/onebit_lamb the optimizer
averages instead) and scales the loss dynamically (fp16; bf16 keeps scale 1).
The evaluation model is a float32 copy holding the master weights.
"""
from __future__ import annotations

import copy
from typing import Any, Dict

import torch

from ...training.base import Algorithm, trainable_parameters
from ...training.ssgd import SSGDConfig
from ...optim import MixedPrecision
from ...optimizer import ring_bytes_sent

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class MixedPrecisionSSGD(Algorithm):
    """Synchronous SGD (every step) with a half-precision model and float32 master weights."""

    name = "ssgd"  # the same trajectory contract as ssgd; checkpoints record --precision besides
    Config = SSGDConfig

    def __init__(self, model, local_optimizer, config: SSGDConfig = None, precision: str = "fp16"):
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {', '.join(DTYPES)}, got {precision!r}")
        super().__init__(model, local_optimizer, config)  # broadcasts rank 0's float32 model
        c = self.config
        if c.compression != "none" or c.backward_passes_per_step != 1:
            raise ValueError("mixed precision reduces the half gradients itself, one backward pass per step: "
                             "compression and backward_passes_per_step do not apply")
        self.precision, self.dtype = precision, DTYPES[precision]
        self.mp = MixedPrecision(model, local_optimizer, dtype=self.dtype)
        self.params = trainable_parameters(model)

    def cast_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if x.is_floating_point() else x

    def backward(self, loss: torch.Tensor) -> None:
        self.mp.backward(loss)

    def zero_grad(self) -> None:
        self.mp.zero_grad(set_to_none=True)

    def step(self) -> None:
        reduced0 = self.mp.bytes_reduced
        opt_sent0 = getattr(self.local_optimizer, "bytes_sent", 0)
        self.mp.step()  # the sync point: overflow flag, then the gradient (or the optimizer's own) allreduce
        half = self.mp.bytes_reduced - reduced0
        self.bytes_reduced += half
        self.bytes_sent += (ring_bytes_sent(half, self.world_size) + ring_bytes_sent(4, self.world_size)
                            + getattr(self.local_optimizer, "bytes_sent", 0) - opt_sent0)
        self.num_syncs += 1
        self.steps += 1

    def sync(self) -> None:
        """Synchronizes inside every step; nothing is ever pending."""

    def eval_parameters(self):
        """The float32 masters, aligned with the model's trainable parameters."""
        masters = {id(p): m for p, m in self.mp._pairs}
        return [masters[id(p)] for p in self.params]

    def _new_eval_model(self) -> torch.nn.Module:
        """eval_model() holds the float32 master weights: a float32 copy of the model."""
        return copy.deepcopy(self.model).float()

    @property
    def loss_scale(self) -> float:
        return self.mp.scale

    @property
    def skipped_steps(self) -> int:
        return self.mp.num_skipped

    def extra_state(self) -> Dict[str, Any]:
        return {"precision": self.precision, "mixed_precision": self.mp.state_dict()}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        if state.get("precision") != self.precision:
            raise ValueError(f"checkpoint was made with precision {state.get('precision')}, this run uses "
                             f"{self.precision}")
        self.mp.load_state_dict(state["mixed_precision"])
