"""A deterministic order of parameter-server turns, for exact reference tests.

``TurnSchedule(ps, order)``: ``order`` lists worker indices; the i-th turn
belongs to worker ``order[i]``. ``with schedule.turn(): ...`` waits for the
token from the previous turn's worker, runs the body, makes sure the servers
have applied everything this worker sent (flush), then hands the token on.
Workers thus act one at a time in the given order, so an asynchronous run has
exactly the staleness the order implies and can be replayed sequentially.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

_TAG = 77


def _max():
    from mpi4py import MPI

    return MPI.MAX


class TurnSchedule:
    def __init__(self, ps, order: Sequence[int]):
        order = [int(k) for k in order]
        bad = [k for k in order if not 0 <= k < ps.num_workers]
        if bad:
            raise ValueError(f"TurnSchedule: worker indices {bad} are outside 0..{ps.num_workers - 1}")
        self.ps, self.order, self.pos = ps, order, 0
        self.me = ps.worker_index
        self.comm = ps.worker_comm

    def global_position(self) -> int:
        """Collective over workers: the turns done by all (call when no turn is in progress)."""
        return self.comm.allreduce(self.pos, op=_max())

    def restart_at(self, pos: int) -> None:
        """Collective over workers: continue with turn `pos` (turns before it done), e.g. after a state
        was loaded. The worker of turn pos - 1 hands the token on again."""
        if not 0 <= pos <= len(self.order):
            raise ValueError(f"TurnSchedule.restart_at: position {pos} outside 0..{len(self.order)}")
        self.comm.Barrier()  # no token of the previous pass is still travelling
        self.pos = pos
        if 0 < pos < len(self.order) and self.order[pos - 1] == self.me and self.order[pos] != self.me:
            self.comm.send(pos, dest=self.order[pos], tag=_TAG)

    def turns_of(self, worker: int) -> int:
        return self.order.count(worker)

    @contextlib.contextmanager
    def turn(self):
        try:
            i = self.order.index(self.me, self.pos)
        except ValueError:
            raise ValueError(f"TurnSchedule: worker {self.me} has no turn left in the order "
                             f"(it has {self.turns_of(self.me)} turns)") from None
        if i > 0 and self.order[i - 1] != self.me:
            self.comm.recv(source=self.order[i - 1], tag=_TAG)
        yield i
        self.ps.flush()
        if i + 1 < len(self.order) and self.order[i + 1] != self.me:
            self.comm.send(i + 1, dest=self.order[i + 1], tag=_TAG)
        self.pos = i + 1
