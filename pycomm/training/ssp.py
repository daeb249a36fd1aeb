"""SSP: stale synchronous parallel (Ho et al. 2013; docs/algorithms.md §5).

Worker k pushes g_k, advances its clock to c and may continue only when
every unfinished worker has reached c - s; the servers then answer with the
weights as they hold them at that moment. s = 0 is BSP (every worker reads
the model after exactly the same gradients); s -> infinity is ASGD.
"""
from __future__ import annotations

from dataclasses import dataclass

from .asgd import check_stall
from .ps_algorithm import PSAlgorithm


@dataclass
class SSPConfig:
    """staleness: the bound s in clocks [3, within the range Ho et al. study].
    stall_report_s: a server names a worker silent this long while others wait (0: never)."""
    staleness: int = 3
    stall_report_s: float = 60.0

    def __post_init__(self):
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness must be an integer >= 0 (0 is BSP), got {self.staleness!r}")
        check_stall(self.stall_report_s)


class SSP(PSAlgorithm):
    name = "ssp"
    Config = SSPConfig

    def staleness_bound(self):
        return self.config.staleness

    def exchange(self, grads) -> None:
        """Push every gradient, then the clock: the weights come back once the bound lets this worker on."""
        pushes = [self.ps.push_async(n, g) for n, g in zip(self.names, grads)]
        self.pull()
        for h in pushes:
            h.wait()

    def pull(self) -> None:
        self.ps.clock_pull(dict(zip(self.names, [p.data for p in self.params])))
