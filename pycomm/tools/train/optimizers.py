"""Optimizers by name: torch.optim's sgd, adagrad, rmsprop, adadelta, adam, radam, and pycomm.optim's
lars, lamb (local, reduced by DistributedOptimizer) and onebit_adam, onebit_lamb (the whole data-parallel step)."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

OPTIMIZERS = ("sgd", "adagrad", "rmsprop", "adadelta", "adam", "radam", "lars", "lamb", "onebit_adam", "onebit_lamb")
# radam 0.01: at 0.001 its variance rectification keeps it at chance for 2 epochs of digits at 4 ranks (23.4,
# 15.0, 9.7% over 3 seeds, 80.2% after 5 epochs); 0.01 reaches 83.6% in 2 (docs/training-defaults.md §5).
# lars 4 with the trust ratio on every tensor (build_optimizer): docs/training-defaults.md §6.
DEFAULT_LR = {"sgd": 0.05, "adagrad": 0.05, "rmsprop": 0.001, "adadelta": 1.0, "adam": 0.001, "radam": 0.01,
              "lars": 4.0, "lamb": 0.01, "onebit_adam": 0.001, "onebit_lamb": 0.01}
MOMENTUM_OPTIMIZERS = ("sgd", "rmsprop", "lars")
DEFAULT_MOMENTUM = {"sgd": 0.9, "rmsprop": 0.0, "lars": 0.9}
# sgd on 1-bit compressed gradients (--compression onebit): heavy-ball momentum applied to the
# error-feedback average amplifies the compression error (79.4% on digits at momentum 0.9, lr 0.05);
# error-feedback 1-bit SGD is plain SGD (Seide et al. 2014; Karimireddy et al. 2019 analyse it without
# momentum), and lr 0.3 without momentum reaches 91.1-92.5% over 3 seeds (docs/training-defaults.md §6).
ONEBIT_SGD_DEFAULTS = {"lr": 0.3, "momentum": 0.0}
#: Optimizers whose step divides by a per-element second moment. Fed 1-bit compressed gradients, that
#: moment measures the compression, not the gradient: error feedback cannot correct a quantity that is
#: nonlinear in the gradient (Tang et al. 2021, §3). pycomm-train refuses them with --compression onebit
#: and points to onebit_adam/onebit_lamb, which compress the momentum after a full-precision warm-up.
ADAPTIVE = ("adagrad", "rmsprop", "adadelta", "adam", "radam", "lamb")


def server_lr(pushers: int) -> float:
    """Default lr of the parameter-server algorithms (training.server_sgd()): sgd's lr / pushers.

    The servers apply every worker's gradient as it arrives, so P pushing workers take P steps of lr
    where SSGD takes one of lr on their average; lr / P gives the same progress per sample
    (docs/training-defaults.md has the rule, its source and the measurements)."""
    if pushers < 1:
        raise ValueError(f"pushers must be >= 1, got {pushers}")
    return DEFAULT_LR["sgd"] / pushers


#: Optimizers that average over ranks themselves (pycomm.optim.OneBitAdam/OneBitLAMB): only with --algorithm ssgd.
SELF_REDUCING = ("onebit_adam", "onebit_lamb")


def default_lr(name: str, compression: str = "none") -> float:
    """pycomm-train's lr for optimizer `name` when --lr is not given."""
    if name == "sgd" and compression == "onebit":
        return ONEBIT_SGD_DEFAULTS["lr"]
    return DEFAULT_LR[name]


def default_momentum(name: str, compression: str = "none") -> float:
    """pycomm-train's momentum for `name` (one of MOMENTUM_OPTIMIZERS) when --momentum is not given."""
    if name == "sgd" and compression == "onebit":
        return ONEBIT_SGD_DEFAULTS["momentum"]
    return DEFAULT_MOMENTUM[name]


def build_optimizer(name: str, params: Iterable[torch.Tensor], lr: Optional[float] = None,
                    momentum: Optional[float] = None, sgd_nesterov: bool = False,
                    weight_decay: float = 0.0, freeze_step: Optional[int] = None,
                    compression: str = "none") -> torch.optim.Optimizer:
    """Optimizer `name`; lr/momentum default per optimizer and gradient compression (default_lr,
    default_momentum).

    lamb excludes the 1-D parameters (biases) from layer adaptation and weight decay. lars applies its
    trust ratio to every tensor: with the biases excluded they take plain momentum SGD steps at lars's
    global lr (an effective 10 x lr at momentum 0.9), which held model averaging, EASGD, ADMM and Hogwild!
    at 43-71% on digits; adapted like the weights, every algorithm reaches 85% (docs/training-defaults.md §6).
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
    lr = default_lr(name, compression) if lr is None else lr
    if not lr > 0:
        raise ValueError(f"--lr must be positive, got {lr}")
    params = list(params)
    if name == "sgd":
        m = default_momentum("sgd", compression) if momentum is None else momentum
        if sgd_nesterov and m <= 0:
            why = (" (with --compression onebit sgd's default momentum is 0)"
                   if momentum is None and compression == "onebit" else "")
            raise ValueError(f"--sgd-nesterov needs --momentum > 0{why}")
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
        from ... import optim  # pycomm.optim: imported on use, the core stays independent of it

        if name == "lars":
            m = DEFAULT_MOMENTUM["lars"] if momentum is None else momentum
            return optim.LARS(params, lr=lr, momentum=m, weight_decay=weight_decay, exclude=None)
        if name == "lamb":
            return optim.LAMB(params, lr=lr, weight_decay=weight_decay)
        if name == "onebit_adam":
            return optim.OneBitAdam(params, lr=lr, weight_decay=weight_decay, freeze_step=freeze_step)
        return optim.OneBitLAMB(params, lr=lr, weight_decay=weight_decay, freeze_step=freeze_step)
    return torch.optim.RAdam(params, lr=lr, weight_decay=weight_decay)
