"""pycomm-train's options for asynchronous training and pycomm-run --servers (one process, no MPI job)."""
import pytest

from pycomm.tools.launcher import parse_args as run_args
from pycomm.tools.train.cli import parse_args, parse_straggler


def test_straggler_parses():
    assert parse_straggler("3:3") == (3, 3.0)
    assert parse_straggler("0:1.5") == (0, 1.5)
    assert parse_straggler(None) is None


@pytest.mark.parametrize("spec,msg", [("3", "expects RANK:FACTOR"), ("a:2", "expects RANK:FACTOR"),
                                      ("1:0.5", "FACTOR >= 1"), ("-1:2", "RANK must be >= 0")])
def test_straggler_errors(spec, msg):
    with pytest.raises(ValueError, match=msg):
        parse_straggler(spec)


def test_cli_takes_async_algorithms_and_options(capsys):
    a = parse_args(["--algorithm", "ssp", "--staleness", "2", "--straggler", "1:3", "--eval-every", "8"])
    assert a.algorithm_config == {"staleness": 2} and a.straggler == (1, 3.0) and a.eval_every == 8
    a = parse_args(["--algorithm", "dcasgd", "--adaptive", "--lambda0", "1.5"])
    assert a.algorithm_config == {"adaptive": True, "lambda0": 1.5}
    with pytest.raises(SystemExit):
        parse_args(["--algorithm", "asgd", "--staleness", "2"])
    assert "--staleness does not apply to --algorithm asgd" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--straggler", "x"])
    assert "--straggler expects RANK:FACTOR" in capsys.readouterr().err


def test_run_servers_option(capsys):
    assert run_args(["-np", "6", "--servers", "2", "python", "x.py"]).servers == 2
    with pytest.raises(SystemExit):
        run_args(["-np", "2", "--servers", "2", "python", "x.py"])
    assert "--servers 2 must be between 0 and 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["--algorithm", "ssgd"], "pycomm-run --servers 1 (PYCOMM_PS_SERVERS) places dedicated parameter-server ranks, "
                              "which only asgd, ssp, dcasgd, adadelay use; --algorithm ssgd would leave them idle"),
    (["--algorithm", "asgd"], "pycomm-run --servers 1: a job of 1 rank(s) needs at least one worker"),
])
def test_train_with_servers_refuses_clearly(monkeypatch, capsys, argv, msg):
    from pycomm.tools.train.__main__ import main

    monkeypatch.setenv("PYCOMM_PS_SERVERS", "1")
    assert main([*argv, "--dataset", "digits", "--epochs", "1", "--no-progress", "--no-bandwidth-table"]) == 2
    assert msg in capsys.readouterr().err
