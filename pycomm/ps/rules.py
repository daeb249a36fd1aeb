"""The server's update rules (docs/algorithms.md §5), run by the C++ kernel csrc/kernels/ps_update_cpu.cpp.

    d = g + wd * w + comp;  v = mu * v + d;  w = w - alpha * v          (v skipped when mu = 0)

comp is DC-ASGD's delay compensation with w_bak, the weights this worker last pulled:
``constant``: lambda * g*g*(w - w_bak); ``adaptive`` (DC-ASGD-a): ms = m ms + (1-m) g*g,
lambda0 / sqrt(ms + eps) * g*g*(w - w_bak). AdaDelay replaces alpha by 1 / (L + c sqrt(t + tau)),
t the updates the shard has had, tau the gradient's staleness.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

COMPENSATIONS = ("none", "constant", "adaptive")


@dataclass
class UpdateRule:
    """lr: step alpha (ignored when adadelay). momentum, weight_decay: as torch.optim.SGD (dampening 0).
    compensation: none | constant | adaptive (DC-ASGD). dc_lambda: lambda, or lambda0 when adaptive.
    ms_decay, eps: DC-ASGD-a's m and eps. adadelay: alpha = 1 / (adadelay_L + adadelay_c sqrt(t + tau))."""
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    compensation: str = "none"
    dc_lambda: float = 0.04
    ms_decay: float = 0.95
    eps: float = 1e-7
    adadelay: bool = False
    adadelay_L: float = 1.0
    adadelay_c: float = 0.0

    def __post_init__(self):
        for name in ("lr", "momentum", "weight_decay", "dc_lambda", "ms_decay", "eps", "adadelay_L", "adadelay_c"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"UpdateRule.{name} must be a finite number, got {v!r}")
        if self.compensation not in COMPENSATIONS:
            raise ValueError(f"UpdateRule.compensation must be one of {', '.join(COMPENSATIONS)}, "
                             f"got {self.compensation!r}")
        if not self.adadelay and self.lr <= 0:
            raise ValueError(f"UpdateRule.lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"UpdateRule.momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0 or self.dc_lambda < 0 or self.eps <= 0:
            raise ValueError("UpdateRule: weight_decay and dc_lambda must be >= 0 and eps > 0, got "
                             f"{self.weight_decay}, {self.dc_lambda}, {self.eps}")
        if not 0 <= self.ms_decay < 1:
            raise ValueError(f"UpdateRule.ms_decay must be in [0, 1), got {self.ms_decay}")
        if self.adadelay and (self.adadelay_L <= 0 or self.adadelay_c < 0):
            raise ValueError(f"AdaDelay needs L > 0 and c >= 0, got L={self.adadelay_L}, c={self.adadelay_c}")

    def native(self) -> dict:
        d = asdict(self)
        d["lambda"] = d.pop("dc_lambda")
        return d
