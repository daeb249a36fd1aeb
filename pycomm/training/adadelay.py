"""AdaDelay: delay-adaptive step sizes (Sra et al. 2015; docs/algorithms.md §5).

A gradient that is tau updates old, arriving when the shard has had t
updates, is applied with alpha(t, tau) = 1 / (L + c sqrt(t + tau)): the
larger the delay, the smaller the step. pycomm sets L = 1 / lr (so the first
step is the local optimizer's lr) and c = delay_scale / lr, i.e.
alpha = lr / (1 + delay_scale sqrt(t + tau)). The paper's c_j is per
coordinate and data dependent; pycomm uses one scalar c [delay_scale 0.05:
the step halves after about 400 updates].
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ps import UpdateRule
from .asgd import check_stall
from .ps_algorithm import PSAlgorithm


@dataclass
class AdaDelayConfig:
    """delay_scale: c * lr in alpha = lr / (1 + delay_scale sqrt(t + tau)) [0.05].
    stall_report_s: a server names a worker silent this long while others wait (0: never)."""
    delay_scale: float = 0.05
    stall_report_s: float = 60.0

    def __post_init__(self):
        if not self.delay_scale >= 0:
            raise ValueError(f"delay_scale must be >= 0, got {self.delay_scale}")
        check_stall(self.stall_report_s)


class AdaDelay(PSAlgorithm):
    name = "adadelay"
    Config = AdaDelayConfig

    def make_rule(self, lr, momentum, weight_decay):
        return UpdateRule(lr=lr, momentum=momentum, weight_decay=weight_decay, adadelay=True,
                          adadelay_L=1.0 / lr, adadelay_c=self.config.delay_scale / lr)
