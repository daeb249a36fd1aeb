"""The part top-k and threshold share: error feedback, the (index, value) allgather and the scatter.

One allreduce of a tensor x of n elements (docs/algorithms.md §5b):

    acc = x + e                             (e: this rank's residual, float32)
    K   = how many elements every rank sends (the subclass: agreed across ranks)
    S   = the K largest |acc| (ties: lower index first), indices ascending
    e  <- acc with S set to 0               (error feedback: the rest waits)
    allgather (index int32, value float32 bit-cast to int32) rows of 2K int32
    out = sum_r scatter(row r) (rank order), / N for op="avg"

The C++ kernels (csrc/kernels/sparse*.{h,cpp,cu}) select and scatter, on the
host or on the tensor's CUDA device. Every rank scatters the same rows in
the same order, so all hold bitwise the same result.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .. import _ops, kernels
from ..compression import Float32Compressor, InFlightByName, _label
from ..runtime import size


class SparseCompressor(InFlightByName, Float32Compressor):
    """Base of TopK and Threshold: per-name residuals in ``state_dict()``, K from :meth:`agreed_k`."""

    name = "sparse"
    kept_per_name = "the error-feedback residuals"

    def __init__(self):
        self._residuals: Dict[str, torch.Tensor] = {}
        self._last_k: Dict[str, int] = {}
        self._init_pending()

    # ---- what a method decides ----
    def agreed_k(self, x: torch.Tensor, residual: torch.Tensor, name: str) -> int:
        """Elements every rank sends for this call (the same on every rank)."""
        raise NotImplementedError

    def _agreement_bytes(self, world: int) -> int:
        return 0

    # ---- state ----
    def residual(self, name: str) -> Optional[torch.Tensor]:
        return self._residuals.get(name)

    def last_k(self, name: str) -> Optional[int]:
        """Elements per rank sent in the last allreduce of `name`."""
        return self._last_k.get(name)

    def state_dict(self) -> Dict[str, Any]:
        self._wait_pending()
        return {"compression": self.name, "residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._wait_pending()
        self._residuals = {k: v.detach().to(torch.float32).reshape(-1).contiguous().clone()
                           for k, v in state.get("residuals", {}).items()}

    def reset(self, name: Optional[str] = None) -> None:
        self._wait_pending()
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def _residual_for(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        r = self._residuals.get(name)
        if r is not None and r.numel() != tensor.numel():
            raise ValueError(f"{self.name}: tensor '{name}' has {tensor.numel()} elements but its residual was made "
                             f"for {r.numel()}; names must be unique per tensor (or call reset('{name}'))")
        if r is None:
            r = self._residuals[name] = torch.zeros(tensor.numel(), dtype=torch.float32, device=tensor.device)
        elif r.device != tensor.device:  # the state follows its tensor
            r = self._residuals[name] = r.to(tensor.device)
        return r

    # ---- the collective ----
    def check(self, tensor, op, name) -> None:
        super().check(tensor, op, name)
        if tensor.numel() >= 1 << 31:
            raise ValueError(f"pycomm.allreduce: compression={self.name!r} addresses elements with int32 indices; "
                             f"tensor{_label(name)} has {tensor.numel()} (split it below 2^31)")

    def wire_bytes(self, numel: int, world_size: int, rank: int = 0) -> int:
        """Bytes for an allgather of K = numel (index, value) pairs: (N - 1) 8 K with a ring."""
        return (world_size - 1) * 8 * numel if world_size > 1 else 0

    def wire_bytes_named(self, name: Optional[str], numel: int, world_size: int, rank: int = 0) -> int:
        k = self._last_k.get(name or "")
        if k is None:
            return 0
        return self.wire_bytes(k, world_size, rank) + self._agreement_bytes(world_size)

    def allreduce_async(self, tensor, op="avg", name=None, out=None, _blocking=False):
        self.check(tensor, op, name)
        self._check_out(tensor, out, name)
        self._wait_previous(name)
        x = tensor.detach().reshape(-1)
        if not x.is_contiguous():
            x = x.contiguous()
        residual = self._residual_for(name, tensor)
        k = int(self.agreed_k(x, residual, name))
        indices, values = kernels.sparse_select(x, residual, k)
        self._last_k[name] = k
        h = _Handle(name, indices, values, tensor.numel(), out if out is not None else tensor, op, self)
        self._track(name, h)
        if _blocking:
            h.wait()
        return h


class _Handle:
    def __init__(self, name, indices, values, n, out, op, owner):
        self._n, self._out, self._op, self._k, self._owner, self._name = n, out, op, indices.numel(), owner, name
        self._result: Optional[torch.Tensor] = None
        self._h = None
        if self._k:
            # One allgather: indices and the float32 values' bits, as int32.
            payload = torch.cat([indices, values.view(torch.int32)])
            self._h = _ops.allgather_async(payload, name=f"{name}.{owner.name}")

    def done(self) -> bool:
        return self._result is not None or (self._h is not None and self._h.done())

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        try:
            world = size()
            out = self._out.reshape(-1) if self._out.is_contiguous() else None
            flat = out if out is not None else torch.empty(self._n, dtype=torch.float32, device=self._out.device)
            if self._h is None:
                flat.zero_()
            else:
                rows = self._h.wait().view(world, 2 * self._k)
                idx = rows[:, :self._k].contiguous()
                val = rows[:, self._k:].contiguous().view(torch.float32)
                kernels.sparse_scatter(idx, val, self._n, 1.0 / world if self._op == "avg" else 1.0, out=flat)
            if out is None:
                self._out.copy_(flat.view_as(self._out))
            self._result = self._out
        finally:
            self._owner._untrack(self._name, self)
        return self._result
