"""Optimizers by name: torch.optim's sgd, adagrad, rmsprop, adadelta, adam, radam, and pycomm.optim's
lars, lamb (local, reduced by DistributedOptimizer) and onebit_adam, onebit_lamb (the whole data-parallel step)."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

OPTIMIZERS = ("sgd", "adagrad", "rmsprop", "adadelta", "adam", "radam", "lars", "lamb", "onebit_adam", "onebit_lamb")
# radam 0.01: at 0.001 its variance rectification keeps it at chance for 2 epochs of digits at 4 ranks (23.4,
# 15.0, 9.7% over 3 seeds, 80.2% after 5 epochs); 0.01 reaches 83.6% in 2 (docs/training-defaults.md §5).
DEFAULT_LR = {"sgd": 0.05, "adagrad": 0.05, "rmsprop": 0.001, "adadelta": 1.0, "adam": 0.001, "radam": 0.01,
              "lars": 2.0, "lamb": 0.01, "onebit_adam": 0.001, "onebit_lamb": 0.01}
MOMENTUM_OPTIMIZERS = ("sgd", "rmsprop", "lars")
DEFAULT_MOMENTUM = {"sgd": 0.9, "rmsprop": 0.0, "lars": 0.9}


def server_lr(pushers: int) -> float:
    """Default lr of the parameter-server algorithms (algorithms.server_sgd()): sgd's lr / pushers.

    The servers apply every worker's gradient as it arrives, so P pushing workers take P steps of lr
    where SSGD takes one of lr on their average; lr / P gives the same progress per sample
    (docs/training-defaults.md has the rule, its source and the measurements)."""
    if pushers < 1:
        raise ValueError(f"pushers must be >= 1, got {pushers}")
    return DEFAULT_LR["sgd"] / pushers


#: Optimizers that average over ranks themselves (pycomm.optim.OneBitAdam/OneBitLAMB): only with --algorithm ssgd.
SELF_REDUCING = ("onebit_adam", "onebit_lamb")


def build_optimizer(name: str, params: Iterable[torch.Tensor], lr: Optional[float] = None,
                    momentum: Optional[float] = None, sgd_nesterov: bool = False,
                    weight_decay: float = 0.0, freeze_step: Optional[int] = None) -> torch.optim.Optimizer:
    """Optimizer `name`; lr/momentum default per optimizer (DEFAULT_LR, DEFAULT_MOMENTUM).

    lars and lamb exclude the 1-D parameters (biases) from layer adaptation and weight decay;
    freeze_step: warm-up steps of onebit_adam / onebit_lamb (required for those, refused for the others).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if momentum is not None and name not in MOMENTUM_OPTIMIZERS:
        raise ValueError(f"--momentum applies to {', '.join(MOMENTUM_OPTIMIZERS[:-1])} and {MOMENTUM_OPTIMIZERS[-1]}, "
                         f"not to {name}")
    if sgd_nesterov and name != "sgd":
        raise ValueError(f"--sgd-nesterov applies to sgd, not to {name}")
    if name in SELF_REDUCING:
        if freeze_step is None or freeze_step < 0:
            raise ValueError(f"--optimizer {name} needs --freeze-step >= 0, got {freeze_step}")
    elif freeze_step is not None:
        raise ValueError(f"--freeze-step applies to {' and '.join(SELF_REDUCING)}, not to {name}")
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
    if name in ("lars", "lamb", "onebit_adam", "onebit_lamb"):
        from .. import optim  # pycomm.optim: imported on use, the core stays independent of it

        if name == "lars":
            m = DEFAULT_MOMENTUM["lars"] if momentum is None else momentum
            return optim.LARS(params, lr=lr, momentum=m, weight_decay=weight_decay)
        if name == "lamb":
            return optim.LAMB(params, lr=lr, weight_decay=weight_decay)
        if name == "onebit_adam":
            return optim.OneBitAdam(params, lr=lr, weight_decay=weight_decay, freeze_step=freeze_step)
        return optim.OneBitLAMB(params, lr=lr, weight_decay=weight_decay, freeze_step=freeze_step)
    return torch.optim.RAdam(params, lr=lr, weight_decay=weight_decay)
