"""pycomm-train's defaults: the parameter servers' lr, refusals at start, the chance-level warning, the help
text and the scikit-learn hint (one process, no MPI job)."""
import argparse
import json
import math
import warnings

import numpy as np
import pytest

from pycomm import training
from pycomm.tools.train.__main__ import main
from pycomm.tools.train.cli import build_parser
from pycomm.tools.train.loop import CHANCE_FRACTION, chance_warning
from pycomm.tools.train.optimizers import DEFAULT_LR, server_lr

FAST = ["--no-progress", "--no-bandwidth-table"]
PS = ["asgd", "ssp", "dcasgd", "adadelay", "hybrid"]


@pytest.fixture
def blobs(tmp_path):
    rng = np.random.default_rng(7)
    y = rng.integers(0, 3, size=80)
    x = rng.normal(size=(80, 1, 3, 3)) + y[:, None, None, None]
    path = tmp_path / "blobs.npz"
    np.savez(path, x_train=x[:64], y_train=y[:64], x_test=x[64:], y_test=y[64:])
    return f"npz:{path}"


def test_server_sgd_algorithms_come_from_the_registry():
    assert training.server_sgd() == PS
    assert server_lr(4) == DEFAULT_LR["sgd"] / 4 and server_lr(1) == DEFAULT_LR["sgd"]
    with pytest.raises(ValueError, match="pushers must be >= 1"):
        server_lr(0)


@pytest.mark.parametrize("algo", PS)
@pytest.mark.parametrize("opt", ["adam", "lars", "lamb", "onebit_adam"])
def test_parameter_server_algorithms_refuse_other_optimizers_at_start(capsys, algo, opt):
    with pytest.raises(SystemExit) as e:
        main(["--algorithm", algo, "--optimizer", opt])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (f"--algorithm {algo}: the parameter servers apply SGD (the sgd optimizer's lr, momentum and weight "
            f"decay are their rule); --optimizer {opt} does not apply, use --optimizer sgd") in err


def test_parameter_server_algorithms_refuse_nesterov(capsys):
    with pytest.raises(SystemExit):
        main(["--algorithm", "dcasgd", "--sgd-nesterov"])
    assert "the parameter servers apply plain momentum; --sgd-nesterov does not apply" in capsys.readouterr().err


def _summary(out):
    return json.loads(out.strip().splitlines()[-1])


def test_server_lr_default_and_given_are_logged(capsys, blobs):
    # one rank: one pushing worker, so the default is sgd's lr itself; --lr is taken exactly as given
    assert main(["--algorithm", "asgd", "--dataset", blobs, "--epochs", "1", "--batch-size", "8", *FAST]) == 0
    out = capsys.readouterr().out
    assert ("pycomm-train: asgd: the servers apply every pushed gradient as it arrives, SGD with lr 0.05 "
            "(default: sgd's 0.05 / 1 pushing worker(s)), momentum 0.9, weight decay 0") in out
    assert _summary(out)["lr"] == 0.05
    assert main(["--algorithm", "ssp", "--lr", "0.0321", "--momentum", "0.5", "--dataset", blobs, "--epochs", "1",
                 "--batch-size", "8", *FAST]) == 0
    out = capsys.readouterr().out
    assert "SGD with lr 0.0321 as given, momentum 0.5, weight decay 0" in out
    assert _summary(out)["lr"] == 0.0321
    assert main(["--dataset", blobs, "--epochs", "1", "--batch-size", "8", *FAST]) == 0
    out = capsys.readouterr().out
    assert "the servers apply" not in out and _summary(out)["lr"] == DEFAULT_LR["sgd"]


def _args(**kw):
    base = dict(algorithm="ssgd", optimizer="sgd")
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("algo,opt,cause", [
    ("asgd", "sgd", "the servers apply every worker's gradient with lr 0.05 as it arrives"),
    ("ssgd", "onebit_adam", "--lr 0.05 too large for onebit_adam, or a warm-up (--freeze-step) too short"),
    ("bmuf", "adam", "--lr 0.05 too large for adam (or far too small)"),
])
def test_chance_warning_names_the_cause(algo, opt, cause):
    chance = math.log(10)
    for loss, acc in ((chance, 10.0), (2.5, 0.0), (float("nan"), 9.9), (float("inf"), 18.9),
                      (CHANCE_FRACTION * chance, 12.0)):
        with pytest.warns(UserWarning, match="at chance level for 10 classes") as rec:
            assert chance_warning(loss, acc, 10, _args(algorithm=algo, optimizer=opt), 0.05)
        assert len(rec) == 1 and cause in str(rec[0].message)
    with pytest.warns(UserWarning, match="after epoch 3 the training loss is 2.400 and the training accuracy 11.0%"):
        chance_warning(2.4, 11.0, 10, _args(algorithm=algo, optimizer=opt), 0.05, epoch=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = _args(algorithm=algo, optimizer=opt)
        assert not chance_warning(CHANCE_FRACTION * chance - 1e-6, 10.0, 10, args, 0.05)
        assert not chance_warning(2.3, 19.0, 10, args, 0.05)  # small logits, right argmax: averaged models
        assert not chance_warning(1.05, 40.0, 3, args, 0.05)  # 3 classes: 33.3% + (100 - 33.3) / 10
        assert not chance_warning(0.3, 95.0, 10, _args(), 0.05)


def test_run_at_chance_warns_once(blobs):
    # lr 1e4 sends the loss to inf/NaN in the first epoch: one warning after epoch 1, none after epoch 2 or 3
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert main(["--lr", "10000", "--dataset", blobs, "--epochs", "3", "--batch-size", "8", *FAST]) == 0
    msgs = [str(w.message) for w in rec if "at chance level" in str(w.message)]
    assert len(msgs) == 1 and "after epoch 1 the training loss is" in msgs[0], msgs
    assert "--lr 10000 too large for sgd" in msgs[0], msgs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a run that learns does not warn
        assert main(["--dataset", blobs, "--epochs", "1", "--batch-size", "8", *FAST]) == 0


def test_help_names_every_kind_of_algorithm_and_dataset():
    text = " ".join(build_parser().format_help().split())
    assert "Data-parallel training with pycomm's algorithms: synchronous (ssgd" in text
    assert "through parameter servers (asgd, ssp, dcasgd, adadelay, hybrid)" in text and "hogwild" in text
    assert "digits | synthetic | synthetic-large | npz:PATH" in text and "pycomm[train]" in text
    assert "asgd, ssp, dcasgd, adadelay, hybrid: sgd only, their servers apply it" in text
    assert "the servers' lr, default sgd's 0.05 divided by the number of workers that push" in text
    assert "the servers' momentum" in text and "the servers' weight decay" in text
    for opt, lr in DEFAULT_LR.items():
        assert f"{opt} {lr:g}" in text


def test_digits_without_scikit_learn_names_the_extra(monkeypatch):
    import importlib.util

    from pycomm.tools.train.data import DataError, load_dataset

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    with pytest.raises(DataError, match=r"pip install 'pycomm\[train\]'"):
        load_dataset("digits")


def test_lars_with_onebit_compression_is_refused_at_start(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--optimizer", "lars", "--compression", "onebit"])
    assert e.value.code == 2
    assert ("--optimizer lars with --compression onebit stays below the accuracy of the other combinations "
            "(measured: 81.9-83.6% on digits") in capsys.readouterr().err


@pytest.mark.parametrize("opt", ["adagrad", "rmsprop", "adadelta", "adam", "radam", "lamb"])
def test_adaptive_optimizers_with_onebit_compression_are_refused_at_start(capsys, opt):
    with pytest.raises(SystemExit) as e:
        main(["--optimizer", opt, "--compression", "onebit"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (f"--optimizer {opt} divides by a second moment of the gradients, which 1-bit compression distorts and "
            "error feedback cannot correct; use --optimizer onebit_adam or onebit_lamb") in err


def test_sgd_with_onebit_compression_defaults_to_plain_sgd():
    import torch

    from pycomm.tools.train.optimizers import ONEBIT_SGD_DEFAULTS, build_optimizer, default_lr, default_momentum

    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = build_optimizer("sgd", params, compression="onebit")
    assert opt.param_groups[0]["lr"] == ONEBIT_SGD_DEFAULTS["lr"] == default_lr("sgd", "onebit") == 0.3
    assert opt.param_groups[0]["momentum"] == default_momentum("sgd", "onebit") == 0.0
    # given values are taken exactly; without compression the plain defaults hold
    opt = build_optimizer("sgd", params, lr=0.07, momentum=0.8, compression="onebit")
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (0.07, 0.8)
    opt = build_optimizer("sgd", params)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (DEFAULT_LR["sgd"], 0.9)
    with pytest.raises(ValueError, match=r"--sgd-nesterov needs --momentum > 0 \(with --compression onebit sgd's "
                                         r"default momentum is 0\)"):
        build_optimizer("sgd", params, sgd_nesterov=True, compression="onebit")


def test_lars_in_pycomm_train_adapts_every_tensor():
    import torch

    from pycomm.tools.train.optimizers import build_optimizer

    w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer("lars", [w, b])
    assert not any(opt.excluded(opt.param_groups[0], p) for p in (w, b))
    assert opt.param_groups[0]["lr"] == DEFAULT_LR["lars"] == 4.0


def test_admm_default_rho():
    assert training.make_config("admm").rho == 0.1
