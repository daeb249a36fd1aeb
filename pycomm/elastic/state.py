"""Training state that survives a rank's death: commit, restore, sync (Horovod Elastic's shape)."""
from __future__ import annotations

import copy
import io
from typing import Any, Callable, Dict, List

import torch

from .. import runtime


def _broadcast_bytes(payload: bytes) -> bytes:
    """Rank 0's bytes, on every rank of pycomm's world (mpi4py; its failures are MPI.Exception)."""
    return runtime.world_comm().bcast(payload if runtime.rank() == 0 else None, root=0)


class State:
    """Objects whose committed values every survivor returns to after a failure.

    ``commit()`` keeps a copy of the current values (call it every few steps: a failure loses
    the work since the last commit); ``restore()`` returns to it; ``sync()`` makes every rank's
    current values rank 0's and commits them, so the commits agree too. Counters passed as
    keyword arguments are attributes (``state.epoch``). Objects with ``state_dict`` /
    ``load_state_dict`` (an ElasticSampler) are saved through them.
    """

    def __init__(self, **objects: Any):
        self._objects: Dict[str, Any] = {}
        self._reset_callbacks: List[Callable[[], None]] = []
        self._committed: Dict[str, Any] = {}
        for name, value in objects.items():
            setattr(self, name, value)
        self.commit()

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            self._objects[name] = value

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # Values <-> a plain dict (tensors cloned, so later steps do not change a commit).
    def _capture(self) -> Dict[str, Any]:
        out = {}
        for name, value in self._objects.items():
            if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
                out[name] = copy.deepcopy(value.state_dict())
            else:
                out[name] = copy.deepcopy(value)
        return out

    def _apply(self, values: Dict[str, Any]) -> None:
        for name, value in values.items():
            current = self._objects.get(name)
            if current is not None and hasattr(current, "load_state_dict") and hasattr(current, "state_dict"):
                current.load_state_dict(copy.deepcopy(value))
            else:
                self._objects[name] = copy.deepcopy(value)

    def commit(self) -> None:
        """Keep the current values as the point to return to after a failure. Local: no communication."""
        self._committed = self._capture()

    def restore(self) -> None:
        """Return to the last commit (this rank's own; sync() then makes every rank's rank 0's)."""
        self._apply(self._committed)

    def sync(self) -> None:
        """Every rank takes rank 0's current values, bit for bit, and commits them."""
        buffer = io.BytesIO()
        torch.save(self._capture(), buffer)
        payload = _broadcast_bytes(buffer.getvalue())
        self._apply(torch.load(io.BytesIO(payload), weights_only=False))  # rank 0 of this job wrote it
        self.commit()

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions called after each recovery, once the state is restored and synced: they adjust
        to the new world (a learning rate scaled by size(), a sampler's partition)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()


class TorchState(State):
    """A model and its optimizer, plus any counters or samplers, as one elastic state.

    ``TorchState(model, optimizer, epoch=0, batch=0, sampler=sampler)``. The optimizer's
    interrupted reductions are forgotten on restore (DistributedOptimizer.reset_after_failure);
    samplers (``ElasticSampler``) re-partition in ``on_reset()``.
    """

    def __init__(self, model: torch.nn.Module = None, optimizer: torch.optim.Optimizer = None, **objects: Any):
        if model is not None:
            objects["model"] = model
        if optimizer is not None:
            objects["optimizer"] = optimizer
        super().__init__(**objects)

    def restore(self) -> None:
        optimizer = self._objects.get("optimizer")
        if hasattr(optimizer, "reset_after_failure"):
            optimizer.reset_after_failure()
        super().restore()

    def on_reset(self) -> None:
        for value in self._objects.values():
            if hasattr(value, "reset") and hasattr(value, "record_batch"):  # an ElasticSampler
                value.reset()
        super().on_reset()
