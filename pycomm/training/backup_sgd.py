"""Synchronous SGD with backup workers (Chen et al. 2016; docs/algorithms.md §4).

With N + B ranks, step k averages the first N gradients to arrive and drops the other B:

    C_k   = the first N ranks whose gradient of step k reached the coordinator (rank 0)
    avg_k = 1/N sum_{r in C_k} g_r(w_k)          (divided by N, not by N + B)
    w_{k+1} = local_optimizer(w_k, avg_k)         on every rank, so every rank holds the same model

The steps run as one backup session of the engine per epoch (csrc/comm/backup_allreduce.cpp has
the schedule and its bytes): the engine thread of every rank takes part in every step's exchange,
a late rank's with zeros, while its Python thread is still computing, so the fast ranks never
wait for a late rank's backward pass. A late rank that hands in its gradient after its step was
decided gets avg_k at once and its gradient is dropped; one whose step was decided before it
started skips the step's forward and backward (``step_decided()``; pycomm-train asks before
computing) and applies avg_k. ``last_counted`` is the counted set C_k of the step just applied,
the same on every rank; ``counted_steps[r]`` how many steps counted rank r.

B = 0 is SSGD on N ranks (every step waits for every gradient). Refused, with the same error on
every rank and before any step: B < 0, B >= the number of ranks, ranks passing different B, a
local optimizer that reduces gradients itself (pycomm.optim.OneBitAdam/OneBitLAMB), parameters
other than float32 in host memory. Gradients travel uncompressed (backup_sgd has no compression
option; pycomm-train refuses --compression with it), and the engine runs nothing else while a
session is open: pycomm-train closes it (``settle()``) at the end of each epoch, before its
metrics allreduce, and before a checkpoint; the next step opens a new one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from .. import _C, collectives
from ..optimizer import ring_bytes_sent
from .base import Algorithm, JobConfigError


@dataclass
class BackupSGDConfig:
    """backup_workers (B): of N + B ranks, each step averages the first N gradients to arrive and
    drops the other B [1]. Checked against the job, and between ranks, when the algorithm is built."""
    backup_workers: int = 1

    def __post_init__(self):
        if isinstance(self.backup_workers, bool) or not isinstance(self.backup_workers, int):
            raise TypeError(f"backup_workers must be an int, got {self.backup_workers!r}")


class BackupSGD(Algorithm):
    name = "backup_sgd"
    Config = BackupSGDConfig

    def __init__(self, model, local_optimizer, config: BackupSGDConfig = None):
        super().__init__(model, local_optimizer, config)
        b = self.config.backup_workers
        # Every rank learns every rank's B before any of them judges it, so a bad or mismatched
        # value fails on every rank with the same message instead of leaving the others waiting.
        everyone = collectives.allgather(torch.tensor([b], dtype=torch.int64), name="backup_sgd.backup_workers")
        values = [int(v) for v in everyone.reshape(-1).tolist()]
        if len(set(values)) > 1:
            raise JobConfigError("backup_sgd: the ranks passed different backup_workers ("
                             + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                             + "); every rank must pass the same B")
        if b < 0:
            raise JobConfigError(f"backup_sgd: backup_workers must be >= 0, got {b}")
        if b >= self.world_size:
            raise JobConfigError(f"backup_sgd: backup_workers {b} >= the job's {self.world_size} rank(s) leaves no "
                             f"gradient to count; each step averages the first N = ranks - B, so B must be at most "
                             f"{self.world_size - 1}")
        if getattr(local_optimizer, "reduces_gradients", False):
            raise JobConfigError(f"backup_sgd: {type(local_optimizer).__name__} reduces gradients itself (the whole "
                             "data-parallel step); backup_sgd averages them, use a local optimizer such as SGD")
        for p in self.params:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise JobConfigError(f"backup_sgd: parameters must be float32 in host memory (the backup session "
                                 f"averages host float32 gradients), got {p.dtype} on {p.device}")
        self.backup_workers = b
        self.counted = self.world_size - b   # N
        self._numel = sum(p.numel() for p in self.params)
        self._avg = torch.zeros(self._numel, dtype=torch.float32)
        self._session = None
        self.last_counted: List[int] = []               # C_k of the step just applied
        self.counted_steps: List[int] = [0] * self.world_size  # per rank: steps in which its gradient counted
        self.dropped = 0   # this rank's gradients handed in after their step was decided
        self.skipped = 0   # steps decided before this rank computed: no forward/backward

    # -- the session --------------------------------------------------------
    def _open(self):
        if self._session is None:
            self._session = _C.BackupSession(self._numel, self.backup_workers, self.steps, "backup_sgd.gradients")
            self._session.open()
        return self._session

    def _close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            session.close(self.steps)

    # -- the training-loop contract ---------------------------------------
    def step_decided(self) -> bool:
        """Whether this step's average is already in without this rank: call step() without computing."""
        return self._open().ready(self.steps)

    def step(self) -> None:
        session = self._open()
        k = self.steps
        grads = [p.grad for p in self.params]
        computed = any(g is not None for g in grads)
        if computed:
            flat = torch.cat([(g if g is not None else torch.zeros_like(p)).detach().reshape(-1)
                              for g, p in zip(grads, self.params)]) if self.params else self._avg.new_zeros(0)
            session.submit(flat.contiguous(), k)  # False: decided without it (counted as dropped below)
        elif not session.ready(k):
            raise RuntimeError(f"backup_sgd.step(): no gradient for step {k} and its average has not come in; "
                               "run the backward pass first (or call step() without one only when step_decided())")
        # ---- sync point: the average of the first N gradients (the engine's session decided it) ----
        mine, counted = session.take(self._avg, k)
        if computed and not mine:
            self.dropped += 1
        if not computed:
            self.skipped += 1
        with torch.no_grad():
            offset = 0
            for p in self.params:
                n = p.numel()
                g = self._avg[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                offset += n
        self.local_optimizer.step()
        self.last_counted = list(counted)
        for r in counted:
            self.counted_steps[r] += 1
        nbytes = 4 * self._numel  # every rank takes part in every step's exchange (a late one with zeros)
        self.bytes_reduced += nbytes
        self.bytes_sent += ring_bytes_sent(nbytes, self.world_size)
        self.num_syncs += 1
        self.steps += 1

    def sync(self) -> None:
        """backup_sgd synchronizes inside every step; nothing is ever pending."""

    def settle(self) -> None:
        """Close the session: waits until every rank has taken the same steps (collective)."""
        self._close()

    def finalize(self) -> None:
        self._close()

    def summary(self) -> Dict[str, Any]:
        """For pycomm-train's summary: B, how many steps counted each rank, this rank's dropped/skipped."""
        return {"backup_workers": self.backup_workers, "counted_steps": list(self.counted_steps),
                "dropped": self.dropped, "skipped": self.skipped}

    def extra_state(self) -> Dict[str, Any]:
        return {"counted_steps": list(self.counted_steps), "dropped": self.dropped, "skipped": self.skipped,
                "last_counted": list(self.last_counted)}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        if self._session is not None:
            raise RuntimeError("backup_sgd: load_state_dict while a session is open; load before training "
                               "or after settle()")
        self.counted_steps = [int(v) for v in state["counted_steps"]]
        self.dropped = int(state["dropped"])
        self.skipped = int(state["skipped"])
        self.last_counted = [int(v) for v in state["last_counted"]]

    def session_open(self) -> bool:
        """Whether this rank's session of the current epoch is open (the engine runs nothing else meanwhile)."""
        return self._session is not None
