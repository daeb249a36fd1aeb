"""What every training algorithm shares: the step/sync contract, flattened averaging, state.

An algorithm owns a model and a local torch.optim optimizer. The training
loop calls, per minibatch::

    algo.zero_grad(); loss_fn(model(x), y).backward(); algo.step()

``step()`` applies the local optimizer and, when the algorithm's schedule
says so, runs its sync point (``sync()``), where the ranks communicate. All
communication goes through pycomm collectives: the tensors of one sync are
flattened into one buffer per dtype and averaged with ``allreduce(op="avg")``.
``finalize()`` runs a last sync if local steps are pending, so that training
ends with one model on every rank. ``eval_parameters()`` is the model to
evaluate (the global/consensus model of the last sync), identical on every
rank and obtained without communication.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import collectives
from ..optimizer import broadcast_parameters, ring_bytes_sent
from ..runtime import joined, size, topology


class JobConfigError(ValueError):
    """A configuration that does not fit the job, raised alike on every rank after the ranks compared it
    (backup_sgd's B against the number of ranks); pycomm-train reports it as a usage error."""


def trainable_parameters(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def clone_tensors(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


class Algorithm:
    """Base class; subclasses set ``name`` and ``Config`` and implement ``step``/``sync``."""

    name = "base"
    Config: Any = None
    # Whether pycomm-train --elastic runs it: it can go on after ranks died, from a state synced from one rank.
    elastic_supported = False

    def __init__(self, model: torch.nn.Module, local_optimizer: torch.optim.Optimizer, config=None):
        topology()  # clear error before init
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{self.name}: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(local_optimizer, torch.optim.Optimizer):
            raise TypeError(f"{self.name}: local_optimizer must be a torch.optim.Optimizer, "
                            f"got {type(local_optimizer).__name__}")
        self.config = self.Config() if config is None else config
        self.model = model
        self.local_optimizer = local_optimizer
        self.optimizer: torch.optim.Optimizer = local_optimizer  # what zero_grad/step act on
        self.world_size = size()
        self.params = trainable_parameters(model)
        self.steps = 0          # local optimizer steps taken
        self.num_syncs = 0      # synchronizations (allreduce rounds) performed
        self.bytes_reduced = 0  # payload bytes averaged
        self.bytes_sent = 0     # per-rank bytes on the wire, ring estimate 2(N-1)/N * S
        # Every rank starts from rank 0's model. A rank that pycomm.elastic.grow started does not take part:
        # the ranks already there wait in pycomm.elastic.run, whose entry syncs the whole state from rank 0.
        if not joined():
            broadcast_parameters(model.state_dict(), root=0)
        self._eval_model: Optional[torch.nn.Module] = None

    # -- the training-loop contract ---------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def step_decided(self) -> bool:
        """Whether this step's update is already known without this rank's gradient, so that the loop
        calls step() without a forward and backward pass: backup_sgd, when the first N of N + B
        gradients came in before this rank computed. False for every other algorithm."""
        return False

    def settle(self) -> None:
        """The training loop calls it before a collective of its own (the end of an epoch's metrics
        allreduce, a checkpoint's barrier): backup_sgd closes its session there, every rank waiting
        until all have taken the same steps. Nothing for the others."""

    def finalize(self) -> None:
        """Synchronize pending local progress so that every rank ends with the same model."""

    def eval_parameters(self) -> List[torch.Tensor]:
        """Parameters to evaluate, aligned with ``trainable_parameters(model)``; the same on every rank."""
        return self.params

    def _new_eval_model(self) -> torch.nn.Module:
        """The module eval_model() fills, made once: a copy of the model."""
        return copy.deepcopy(self.model)

    def eval_model(self) -> torch.nn.Module:
        """A copy of the model holding ``eval_parameters()`` (and the model's buffers)."""
        if self._eval_model is None:
            self._eval_model = self._new_eval_model()
        with torch.no_grad():
            for dst, src in zip(trainable_parameters(self._eval_model), self.eval_parameters()):
                dst.copy_(src)
            for dst, src in zip(self._eval_model.buffers(), self.model.buffers()):
                dst.copy_(src)
        return self._eval_model

    # -- communication helpers ----------------------------------------------
    def average_(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Replace every tensor by its average over ranks: one flattened allreduce per dtype."""
        groups: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for dtype, ts in groups.items():
                flat = torch.cat([t.reshape(-1) for t in ts])
                if flat.numel() == 0:
                    continue
                collectives.allreduce(flat, op="avg", name=f"{self.name}.{what}")
                nbytes = flat.numel() * flat.element_size()
                self.bytes_reduced += nbytes
                self.bytes_sent += ring_bytes_sent(nbytes, self.world_size)
                offset = 0
                for t in ts:
                    n = t.numel()
                    t.copy_(flat[offset:offset + n].view_as(t))
                    offset += n

    def average_gradients_(self) -> None:
        """SSGD step: g <- avg_k g_k over the trainable parameters (a missing gradient counts as zero)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.average_([p.grad for p in self.params], "gradients")

    # -- optimizer state helpers -------------------------------------------
    def optimizer_state_tensors(self, keys: Sequence[str]) -> List[torch.Tensor]:
        """The local optimizer's per-parameter state tensors named `keys`, in parameter order."""
        out = []
        for p in self.params:
            st = self.local_optimizer.state.get(p, {})
            for k in keys:
                v = st.get(k)
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape:
                    out.append(v)
        return out

    def reset_after_failure(self) -> None:
        """Ranks died and pycomm runs again on the survivors (pycomm.elastic): take the new world size and
        forget the reductions the failure interrupted."""
        self.world_size = size()
        if hasattr(self.optimizer, "reset_after_failure"):
            self.optimizer.reset_after_failure()

    # -- state ---------------------------------------------------------------
    def extra_state(self) -> Dict[str, Any]:
        return {}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue exactly: model, local optimizer, counters, algorithm state."""
        return {
            "algorithm": self.name,
            "config": dataclasses.asdict(self.config),
            "world_size": self.world_size,
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.local_optimizer.state_dict()),
            "steps": self.steps,
            "num_syncs": self.num_syncs,
            "bytes_reduced": self.bytes_reduced,
            "bytes_sent": self.bytes_sent,
            "extra": self.extra_state(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("algorithm") != self.name:
            raise ValueError(f"cannot load a {state.get('algorithm')!r} state into algorithm {self.name!r}")
        if state.get("world_size") != self.world_size:
            raise ValueError(f"{self.name}: state was saved at {state.get('world_size')} ranks, "
                             f"this job has {self.world_size}")
        if state.get("config") != dataclasses.asdict(self.config):
            raise ValueError(f"{self.name}: saved config {state.get('config')} differs from "
                             f"this run's {dataclasses.asdict(self.config)}")
        self.model.load_state_dict(state["model"])
        self.local_optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        self.num_syncs = int(state["num_syncs"])
        self.bytes_reduced = int(state["bytes_reduced"])
        self.bytes_sent = int(state["bytes_sent"])
        self.load_extra_state(state["extra"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"
