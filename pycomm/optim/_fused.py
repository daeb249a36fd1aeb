"""Calls into pycomm's fused LARS/LAMB kernels (csrc/kernels/optim_update_cpu.cpp)."""
from __future__ import annotations

import warnings

import torch

from .. import _C


def applies(opt, *tensors: torch.Tensor) -> bool:
    """True if the fused kernel takes these tensors (float32, CPU, contiguous); else warn once per optimizer."""
    ok = all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
    if not ok and not getattr(opt, "_fused_warned", False):
        opt._fused_warned = True
        t = tensors[0]
        warnings.warn(f"{type(opt).__name__}(fused=True): the fused kernel takes contiguous float32 CPU tensors; "
                      f"a {str(t.dtype).replace('torch.', '')} tensor on {t.device} is updated with torch ops",
                      RuntimeWarning, stacklevel=3)
    return ok


def lars_(p, g, buf, lr, momentum, wd, eta, eps, adapt) -> float:
    return _C.lars_update_(p, g, buf, lr, momentum, wd, eta, eps, adapt)


def lamb_(p, g, m, v, lr, b1, b2, eps, wd, c1, c2, lo, hi, adapt) -> float:
    return _C.lamb_update_(p, g, m, v, lr, b1, b2, eps, wd, c1, c2, lo, hi, adapt)
