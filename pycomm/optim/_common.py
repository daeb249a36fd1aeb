"""Helpers shared by pycomm.optim: parameter exclusion (Jia et al.) and trust ratios."""
from __future__ import annotations

from typing import Callable, Optional

import torch

#: Default exclusion predicate: biases and normalisation weights/offsets are the 1-D parameters.
def exclude_1d(p: torch.Tensor) -> bool:
    """True for parameters with at most one dimension (biases, BatchNorm/LayerNorm weights and offsets)."""
    return p.dim() <= 1


def resolve_exclude(exclude) -> Optional[Callable[[torch.Tensor], bool]]:
    """`exclude` as a predicate: None/False (exclude nothing), True/"1d" (exclude_1d) or a callable."""
    if exclude is None or exclude is False:
        return None
    if exclude is True or exclude == "1d":
        return exclude_1d
    if callable(exclude):
        return exclude
    raise TypeError(f"exclude must be None, True, '1d' or a callable(param) -> bool, got {exclude!r}")


def is_excluded(group: dict, p: torch.Tensor, predicate) -> bool:
    """A group's explicit ``exclude`` flag wins over the predicate."""
    flag = group.get("exclude")
    if isinstance(flag, bool):
        return flag
    return bool(predicate(p)) if predicate is not None else False


def check_positive(name: str, value, allow_zero: bool = True) -> None:
    if not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")


def check_betas(betas) -> None:
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
