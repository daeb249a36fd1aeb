"""Mixed precision training with dynamic loss scaling (Micikevicius et al. 2018; Jia et al. 2018).

    model = Net()
    opt = pycomm.optim.LARS(model.parameters(), lr=...)        # built over the float32 parameters
    mp = pycomm.optim.MixedPrecision(model, opt, dtype=torch.float16)
    for x, y in data:
        mp.zero_grad()
        loss = loss_fn(model(x.half()), y)                     # forward and backward in fp16
        mp.backward(loss)                                      # (loss * scale).backward()
        mp.step()                                              # False if the step was skipped

What it does:

- The model's parameters and buffers become ``dtype`` (float16 or bfloat16)
  in place; the optimizer keeps float32 master copies (its param_groups now
  hold the masters; the model's half tensors are what backward sees).
- ``step()``: every rank checks its half gradients for inf/NaN, and the ranks
  agree on the decision with one allreduce of a single int32 flag (op max),
  so all ranks skip or all step. On overflow: no update, scale <- scale *
  backoff_factor (0.5), clean-step counter reset. Else the gradients are
  averaged by pycomm in ``dtype`` (one flat allreduce per step, half the
  bytes of float32; op avg divides before summing), unscaled into float32
  master gradients (g / scale), optionally clipped (max_grad_norm, on the
  averaged gradient, so identical on every rank), the optimizer steps on the
  masters and the model gets the rounded masters. After growth_interval clean
  steps in a row the scale is multiplied by growth_factor (2).
- bfloat16 has float32's range: by default its scale stays 1 (dynamic=False);
  overflow still skips the step on every rank.
- With an optimizer that reduces by itself (OneBitAdam, OneBitLAMB), the
  gradients are not averaged here: only the overflow flag is agreed on.
- ``state_dict()``: the optimizer's state, the master weights, the scale and
  the clean-step counter.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .. import collectives
from ..optimizer import DistributedOptimizer
from ..runtime import size, topology

HALF_DTYPES = (torch.float16, torch.bfloat16)


class MixedPrecision:
    """Half-precision model, float32 master weights in `optimizer`, loss scaling agreed across ranks.

    model: the torch.nn.Module (float32 when passed; converted to `dtype` in place).
    optimizer: a torch.optim optimizer built over ``model.parameters()`` (not yet stepped).
    dtype: torch.float16 or torch.bfloat16.
    init_scale, growth_factor, backoff_factor, growth_interval: dynamic loss scaling (torch.amp's defaults).
    dynamic: change the scale (default: True for float16, False for bfloat16, whose scale stays init_scale=1).
    reduce: average the gradients over ranks (default: unless the optimizer reduces by itself).
    max_grad_norm: clip the float32 averaged gradient to this norm (None: no clipping).
    algorithm: pycomm allreduce algorithm for the gradients.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype = torch.float16,
                 init_scale: Optional[float] = None, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, dynamic: Optional[bool] = None, reduce: Optional[bool] = None,
                 max_grad_norm: Optional[float] = None, algorithm: str = "auto"):
        if dtype not in HALF_DTYPES:
            raise ValueError(f"MixedPrecision: dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"MixedPrecision wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("MixedPrecision reduces the half-precision gradients itself; pass the plain optimizer, "
                            "not a DistributedOptimizer")
        if optimizer.state:
            raise ValueError("MixedPrecision: build it before the optimizer's first step (the optimizer has state)")
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, {backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval!r}")
        topology()
        self.model, self.optimizer, self.dtype = model, optimizer, dtype
        self.dynamic = (dtype == torch.float16) if dynamic is None else bool(dynamic)
        if init_scale is None:
            init_scale = 2.0 ** 16 if self.dynamic else 1.0
        if not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0
        self.reduce = (not getattr(optimizer, "reduces_gradients", False)) if reduce is None else bool(reduce)
        self.max_grad_norm = max_grad_norm
        self.algorithm = algorithm
        self.num_skipped = 0
        self.bytes_reduced = 0

        model_params = {id(p): p for p in model.parameters()}
        self._pairs: List[tuple] = []  # (half model param, float32 master)
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                if id(p) not in model_params:
                    raise ValueError("MixedPrecision: the optimizer holds a tensor that is not a parameter of the model")
                if p.dtype != torch.float32:
                    raise TypeError(f"MixedPrecision: pass the model in float32 (a parameter is {p.dtype})")
                master = p.detach().clone()
                master.requires_grad_(p.requires_grad)
                masters.append(master)
                self._pairs.append((p, master))
            group["params"] = masters
        with torch.no_grad():
            model.to(dtype)

    # -- the training step ------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.scale

    def backward(self, loss: torch.Tensor) -> None:
        """(loss * scale).backward()"""
        self.scale_loss(loss).backward()

    def _trained(self):
        return [(p, m) for p, m in self._pairs if p.requires_grad]

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Reduce, check, unscale, clip, step, copy back. Returns False when every rank skipped the step."""
        if closure is not None:
            with torch.enable_grad():
                self.backward(closure())
        pairs = self._trained()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p, _ in pairs]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0, dtype=self.dtype)
        local_bad = 0 if bool(torch.isfinite(flat).all()) else 1
        flag = torch.tensor([local_bad], dtype=torch.int32)
        if size() > 1:
            collectives.allreduce(flag, op="max", name="MixedPrecision.overflow")
        overflow = bool(flag.item())
        if not overflow and self.reduce and size() > 1 and flat.numel():
            collectives.allreduce(flat, op="avg", algorithm=self.algorithm, name="MixedPrecision.grad")
            self.bytes_reduced += flat.numel() * flat.element_size()
            # The average of finite half values can still overflow the range; the result is the same
            # on every rank (bitwise), so every rank takes the same decision without another message.
            overflow = not bool(torch.isfinite(flat).all())
        if overflow:
            self.num_skipped += 1
            if self.dynamic:
                self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return False
        inv = 1.0 / self.scale
        offset = 0
        for (p, master), g in zip(pairs, grads):
            n = p.numel()
            g32 = flat[offset:offset + n].view_as(p).float().mul_(inv)
            master.grad = g32
            offset += n
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([m for _, m in pairs], self.max_grad_norm)
        self.optimizer.step()
        for p, master in pairs:
            p.copy_(master)
        if self.dynamic:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0
        return True

    # -- checkpoints -------------------------------------------------------------
    def master_params(self) -> List[torch.Tensor]:
        return [m for _, m in self._pairs]

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scale": self.scale, "growth_tracker": self.growth_tracker,
                "num_skipped": self.num_skipped, "dtype": str(self.dtype),
                "master": [m.detach().clone() for _, m in self._pairs]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state.get("dtype") != str(self.dtype):
            raise ValueError(f"MixedPrecision: checkpoint is for {state.get('dtype')}, this run uses {self.dtype}")
        masters = state["master"]
        if len(masters) != len(self._pairs):
            raise ValueError(f"MixedPrecision: checkpoint has {len(masters)} master tensors, the model "
                             f"{len(self._pairs)}")
        for (p, m), saved in zip(self._pairs, masters):
            if saved.shape != m.shape:
                raise ValueError(f"MixedPrecision: master tensor of shape {tuple(saved.shape)} does not fit a "
                                 f"parameter of shape {tuple(m.shape)}")
            m.copy_(saved)
            p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.num_skipped = int(state.get("num_skipped", 0))
