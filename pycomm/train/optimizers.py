"""Local optimizers by name: any of torch.optim's sgd, adagrad, rmsprop, adadelta, adam, radam."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

OPTIMIZERS = ("sgd", "adagrad", "rmsprop", "adadelta", "adam", "radam")
DEFAULT_LR = {"sgd": 0.05, "adagrad": 0.05, "rmsprop": 0.001, "adadelta": 1.0, "adam": 0.001, "radam": 0.001}
MOMENTUM_OPTIMIZERS = ("sgd", "rmsprop")
DEFAULT_MOMENTUM = {"sgd": 0.9, "rmsprop": 0.0}


def build_optimizer(name: str, params: Iterable[torch.Tensor], lr: Optional[float] = None,
                    momentum: Optional[float] = None, sgd_nesterov: bool = False,
                    weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """torch.optim optimizer `name`; lr/momentum default per optimizer (DEFAULT_LR, DEFAULT_MOMENTUM)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if momentum is not None and name not in MOMENTUM_OPTIMIZERS:
        raise ValueError(f"--momentum applies to {' and '.join(MOMENTUM_OPTIMIZERS)}, not to {name}")
    if sgd_nesterov and name != "sgd":
        raise ValueError(f"--sgd-nesterov applies to sgd, not to {name}")
    lr = DEFAULT_LR[name] if lr is None else lr
    if not lr > 0:
        raise ValueError(f"--lr must be positive, got {lr}")
    params = list(params)
    if name == "sgd":
        m = DEFAULT_MOMENTUM["sgd"] if momentum is None else momentum
        if sgd_nesterov and m <= 0:
            raise ValueError("--sgd-nesterov needs --momentum > 0")
        return torch.optim.SGD(params, lr=lr, momentum=m, nesterov=sgd_nesterov, weight_decay=weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
    if name == "rmsprop":
        m = DEFAULT_MOMENTUM["rmsprop"] if momentum is None else momentum
        return torch.optim.RMSprop(params, lr=lr, momentum=m, weight_decay=weight_decay)
    if name == "adadelta":
        return torch.optim.Adadelta(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.RAdam(params, lr=lr, weight_decay=weight_decay)
