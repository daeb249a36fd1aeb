"""DC-ASGD: delay-compensated ASGD (Zheng et al., ICML 2017; docs/algorithms.md §5).

The servers keep w_bak(k), the weights worker k last pulled, and apply
w <- w - eta (g_k + lambda g_k * g_k * (w - w_bak(k))): a first-order Taylor
correction of the stale gradient with a diagonal Hessian approximation.
Constant lambda [0.04], or adaptive DC-ASGD-a: MS <- m MS + (1-m) g*g,
lambda_t = lambda0 / sqrt(MS + eps) [lambda0 = 2, m = 0.95, eps = 1e-7];
one MS per server shard, updated by every worker's pushes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ps import UpdateRule
from .asgd import check_stall
from .ps_algorithm import PSAlgorithm


@dataclass
class DCASGDConfig:
    """dc_lambda: constant lambda [0.04]. adaptive: DC-ASGD-a. lambda0, ms_decay, eps: its lambda0 [2],
    m [0.95] and eps [1e-7]. stall_report_s: a server names a worker silent this long (0: never)."""
    dc_lambda: float = 0.04
    adaptive: bool = False
    lambda0: float = 2.0
    ms_decay: float = 0.95
    eps: float = 1e-7
    stall_report_s: float = 60.0

    def __post_init__(self):
        if not self.dc_lambda >= 0 or not self.lambda0 >= 0:
            raise ValueError(f"dc_lambda and lambda0 must be >= 0, got {self.dc_lambda}, {self.lambda0}")
        if not 0 <= self.ms_decay < 1:
            raise ValueError(f"ms_decay must be in [0, 1), got {self.ms_decay}")
        if not self.eps > 0:
            raise ValueError(f"eps must be positive, got {self.eps}")
        check_stall(self.stall_report_s)


class DCASGD(PSAlgorithm):
    name = "dcasgd"
    Config = DCASGDConfig

    def make_rule(self, lr, momentum, weight_decay):
        c = self.config
        return UpdateRule(lr=lr, momentum=momentum, weight_decay=weight_decay,
                          compensation="adaptive" if c.adaptive else "constant",
                          dc_lambda=c.lambda0 if c.adaptive else c.dc_lambda, ms_decay=c.ms_decay, eps=c.eps)
