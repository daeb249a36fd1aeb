"""ASGD: asynchronous SGD through the parameter server (docs/algorithms.md §5).

Each worker pushes g_k and pulls w, never waiting for the others; the server
applies w <- w - eta g_k (with torch.optim.SGD's momentum and weight decay)
as each push arrives, so g_k is stale by tau_k updates (reported).
"""
from __future__ import annotations

from dataclasses import dataclass

from .ps_algorithm import PSAlgorithm


def check_stall(v: float) -> None:
    if not v >= 0:
        raise ValueError(f"stall_report_s must be >= 0 (0: never report), got {v}")


@dataclass
class ASGDConfig:
    """stall_report_s: a server names a worker silent this long while others wait (0: never)."""
    stall_report_s: float = 60.0

    def __post_init__(self):
        check_stall(self.stall_report_s)


class ASGD(PSAlgorithm):
    name = "asgd"
    Config = ASGDConfig
