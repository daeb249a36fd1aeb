"""The algorithm registry and config validation (one process)."""
import pytest
import torch

import pycomm
from pycomm import training


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    pycomm.init()
    yield


def model_and_opt():
    m = torch.nn.Linear(3, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def test_unknown_algorithm_lists_choices():
    with pytest.raises(ValueError, match=r"unknown algorithm 'bmf'; choose one of ssgd, model_averaging, bmuf, "
                                         r"easgd, admm"):
        training.create("bmf", *model_and_opt())


def test_option_of_another_algorithm_is_named():
    with pytest.raises(ValueError, match=r"option\(s\) rho do not apply to algorithm 'bmuf'; its options are: "
                                         r"sync_period, block_momentum"):
        training.create("bmuf", *model_and_opt(), rho=1.0)


def test_defaults_from_the_papers():
    c = training.BMUFConfig()
    assert (c.sync_period, c.block_momentum, c.block_lr, c.nesterov, c.reset_local_momentum, c.warmup_steps,
            c.moment_sync) == (50, None, 1.0, True, True, 500, "average")
    assert training.EASGDConfig().beta == 0.9 and training.EASGDConfig().alpha is None
    assert training.SSGDConfig().compression == "none"


@pytest.mark.parametrize("name,cfg,msg", [
    ("bmuf", {"moment_sync": "sum"}, "unknown moment_sync 'sum'; choose one of average, keep, reset"),
    ("bmuf", {"block_momentum": 1.0}, r"block_momentum must be in \[0, 1\)"),
    ("model_averaging", {"sync_period": 0}, "sync_period must be >= 1"),
    ("admm", {"rho": 0.0}, "rho must be positive"),
    ("easgd", {"beta": 1.5}, r"beta must be in \[0, 1\]"),
    ("ssgd", {"compression": "fp8"}, "unknown compression 'fp8'; supported: none, fp16, bf16, onebit"),
])
def test_bad_values(name, cfg, msg):
    with pytest.raises(ValueError, match=msg):
        training.make_config(name, **cfg)


def test_local_optimizer_must_be_torch_optimizer():
    m, _ = model_and_opt()
    with pytest.raises(TypeError, match="local_optimizer must be a torch.optim.Optimizer"):
        training.create("model_averaging", m, object())
