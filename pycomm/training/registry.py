"""One registry for the training algorithms: ``create(name, model, local_optimizer, **config)``."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Type

import torch

from .adadelay import AdaDelay
from .admm import ADMM
from .asgd import ASGD
from .backup_sgd import BackupSGD
from .base import Algorithm
from .bmuf import BMUF
from .dcasgd import DCASGD
from .easgd import EASGD
from .ec_dnn import ECDNN
from .hogwild import Hogwild
from .hybrid import Hybrid
from .model_averaging import ModelAveraging
from .ps_algorithm import PSAlgorithm
from .ssgd import SSGD
from .ssp import SSP

ALGORITHMS: Dict[str, Type[Algorithm]] = {cls.name: cls for cls in (SSGD, ModelAveraging, BMUF, EASGD, ADMM,
                                                                    ASGD, SSP, DCASGD, AdaDelay, Hogwild, Hybrid,
                                                                    ECDNN, BackupSGD)}


def names() -> List[str]:
    return list(ALGORITHMS)


def server_sgd() -> List[str]:
    """The algorithms whose parameter servers apply every pushed gradient with SGD: the local optimizer
    must be torch.optim.SGD, and its lr, momentum and weight decay become the servers' rule."""
    return [n for n, c in ALGORITHMS.items() if issubclass(c, PSAlgorithm)]


def get(name: str) -> Type[Algorithm]:
    """The algorithm class registered as `name`; ValueError listing the choices otherwise."""
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}") from None


def config_fields(name: str) -> List[str]:
    return [f.name for f in dataclasses.fields(get(name).Config)]


def make_config(name: str, **config):
    """Build `name`'s config dataclass; an option it does not have is a ValueError naming its options."""
    cls = get(name)
    fields = config_fields(name)
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(f"option(s) {', '.join(unknown)} do not apply to algorithm {name!r}; "
                         f"its options are: {', '.join(fields) or '(none)'}")
    return cls.Config(**config)


def create(name: str, model: torch.nn.Module, local_optimizer: torch.optim.Optimizer, **config) -> Algorithm:
    """Instantiate algorithm `name` on `model` with `local_optimizer` and config overrides.

    Collective: every rank must call it (rank 0's model is broadcast).
    """
    cfg = make_config(name, **config)
    return get(name)(model, local_optimizer, cfg)
