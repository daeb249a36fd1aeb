"""pycomm-train: option and input errors (in process), errors on every rank and exact resume (under mpirun)."""
import json
import os
import sys

import numpy as np
import pytest

from mpi_launch import run_under_mpi
from pycomm.tools.train.__main__ import main

FAST = ["--no-progress", "--no-bandwidth-table"]


def error_of(capsys, argv):
    with pytest.raises(SystemExit) as e:
        sys.exit(main(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_unknown_algorithm_and_optimizer_list_choices(capsys):
    err = error_of(capsys, ["--algorithm", "sgdx"])
    assert "unknown algorithm 'sgdx'; choose one of ssgd, model_averaging, bmuf, easgd, admm" in err
    err = error_of(capsys, ["--optimizer", "lion"])
    assert ("unknown optimizer 'lion'; choose one of sgd, adagrad, rmsprop, adadelta, adam, radam, lars, lamb, "
            "onebit_adam, onebit_lamb") in err


def test_option_not_belonging_to_algorithm(capsys):
    err = error_of(capsys, ["--algorithm", "model_averaging", "--block-momentum", "0.5"])
    assert "--block-momentum does not apply to --algorithm model_averaging; its options are: --sync-period" in err
    err = error_of(capsys, ["--algorithm", "bmuf", "--moment-sync", "sum"])
    assert "invalid choice: 'sum'" in err
    err = error_of(capsys, ["--algorithm", "ssgd", "--compression", "fp8"])
    assert "unknown compression 'fp8'; supported: none, fp16, bf16, onebit" in err
    err = error_of(capsys, ["--optimizer", "adam", "--momentum", "0.9"])
    assert "--momentum applies to sgd, rmsprop and lars, not to adam" in err


def test_backup_sgd_is_listed_and_refuses_what_it_cannot_serve(capsys):
    from pycomm.tools.train.cli import build_parser

    text = build_parser().format_help()
    assert "backup_sgd" in text and "--backup-workers" in text
    err = error_of(capsys, ["--algorithm", "backup_sgd", "--compression", "fp16"])
    assert "--compression does not apply to --algorithm backup_sgd; its options are: --backup-workers" in err
    err = error_of(capsys, ["--algorithm", "backup_sgd", "--staleness", "2"])
    assert "--staleness does not apply to --algorithm backup_sgd" in err
    err = error_of(capsys, ["--algorithm", "backup_sgd", "--precision", "fp16"])
    assert "--precision fp16 applies to --algorithm ssgd" in err
    err = error_of(capsys, ["--algorithm", "backup_sgd", "--optimizer", "onebit_adam"])
    assert "use it with --algorithm ssgd, not backup_sgd" in err
    err = error_of(capsys, ["--algorithm", "ssgd", "--backup-workers", "1"])
    assert "--backup-workers does not apply to --algorithm ssgd" in err
    err = error_of(capsys, ["--algorithm", "backup_sgd", "--epochs", "1", *FAST])  # one rank: B = 1 is too many
    assert ("pycomm-train: error: backup_sgd: backup_workers 1 >= the job's 1 rank(s) leaves no gradient to "
            "count") in err


def test_every_sample_needs_ssgd_uncompressed_per_epoch_checkpoints(capsys):
    assert "--every-sample needs --algorithm ssgd" in error_of(capsys, ["--every-sample", "--algorithm", "easgd"])
    assert "--every-sample needs --algorithm ssgd" in error_of(capsys, ["--every-sample", "--precision", "fp16"])
    err = error_of(capsys, ["--every-sample", "--compression", "fp16"])
    assert "cannot answer compressed allreduces" in err, err
    err = error_of(capsys, ["--every-sample", "--checkpoint-dir", "/tmp/x", "--checkpoint-every", "5"])
    assert "checkpoint per epoch" in err, err


def test_bad_npz(capsys, tmp_path):
    err = error_of(capsys, ["--dataset", f"npz:{tmp_path}/none.npz", *FAST])
    assert f"npz file '{tmp_path}/none.npz' does not exist" in err
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file")
    assert "cannot read npz file" in error_of(capsys, ["--dataset", f"npz:{bad}", *FAST])
    partial = tmp_path / "partial.npz"
    np.savez(partial, x_train=np.zeros((10, 4)), y_train=np.zeros(10, dtype=np.int64))
    err = error_of(capsys, ["--dataset", f"npz:{partial}", *FAST])
    assert "lacks array(s) x_test, y_test" in err
    shape = tmp_path / "shape.npz"
    np.savez(shape, x_train=np.zeros((10, 4)), y_train=np.zeros(9, dtype=np.int64), x_test=np.zeros((3, 4)),
             y_test=np.zeros(3, dtype=np.int64))
    assert "y_train has shape (9,), x_train has (10, 4)" in error_of(capsys, ["--dataset", f"npz:{shape}", *FAST])
    flat = tmp_path / "flat.npz"
    np.savez(flat, x_train=np.zeros((10, 4)), y_train=np.zeros(10, dtype=np.int64), x_test=np.zeros((3, 4)),
             y_test=np.zeros(3, dtype=np.int64))
    err = error_of(capsys, ["--dataset", f"npz:{flat}", "--model", "cnn", *FAST])
    assert "--model cnn needs image inputs" in err


def test_npz_trains_and_batch_larger_than_shard(capsys, tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "blobs.npz"
    y = rng.integers(0, 3, size=60)
    x = rng.normal(size=(60, 5)) + 3 * y[:, None]
    np.savez(path, x_train=x[:48], y_train=y[:48], x_test=x[48:], y_test=y[48:])
    assert main(["--dataset", f"npz:{path}", "--epochs", "3", "--batch-size", "8", *FAST]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 18 and summary["final_test_accuracy"] > 50
    err = error_of(capsys, ["--dataset", f"npz:{path}", "--batch-size", "49", *FAST])
    assert "--batch-size 49 is larger than a rank's shard (48 samples = 48 training samples / 1 ranks)" in err


def test_error_on_every_rank_exits_without_hanging(tmp_path):
    rc, out = run_under_mpi(2, ["-m", "pycomm.tools.train", "--batch-size", "1000", *FAST], timeout=120)
    assert rc != 0 and rc != -9, out
    assert out.count("--batch-size 1000 is larger than a rank's shard (719 samples") == 1, out


def run_train(tmp, *extra):
    args = ["-m", "pycomm.tools.train", "--algorithm", "bmuf", "--optimizer", "adam", "--sync-period", "4",
            "--warmup-steps", "3", "--epochs", "3", "--batch-size", "64", *FAST, *extra]
    return run_under_mpi(2, args, timeout=240)


def summary_of(out):
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, out
    return json.loads(lines[-1])


def test_killed_and_resumed_run_is_bitwise_identical(tmp_path):
    # 2 ranks, 719 samples each, batch 64: 12 steps per epoch, 36 in all.
    rc, out = run_train(tmp_path, "--checkpoint-dir", str(tmp_path / "a"))
    assert rc == 0, out
    whole = summary_of(out)
    ck = str(tmp_path / "b")
    rc, out = run_train(tmp_path, "--checkpoint-dir", ck, "--checkpoint-every", "5", "--crash-at-step", "18")
    assert rc != 0 and "{" not in out, out  # killed mid-epoch 2, mid-block, after the checkpoint at step 15
    assert open(os.path.join(ck, "latest")).read().strip() == "15"
    rc, out = run_train(tmp_path, "--checkpoint-dir", ck, "--checkpoint-every", "5", "--resume")
    assert rc == 0, out
    assert "resumed at epoch 2, step 3 of 12 (global step 15)" in out
    resumed = summary_of(out)
    assert resumed["model_sha256"] == whole["model_sha256"]
    for key in ("final_train_loss", "final_test_accuracy", "syncs", "bytes_sent", "steps"):
        assert resumed[key] == whole[key], key


@pytest.fixture
def blobs(tmp_path):
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, size=80)
    x = rng.normal(size=(80, 1, 3, 3)) + y[:, None, None, None]
    path = tmp_path / "blobs.npz"
    np.savez(path, x_train=x[:64], y_train=y[:64], x_test=x[64:], y_test=y[64:])
    return f"npz:{path}"


@pytest.mark.parametrize("argv,syncs", [
    (["--algorithm", "ssgd", "--optimizer", "rmsprop", "--model", "cnn"], 16),
    (["--algorithm", "model_averaging", "--sync-period", "3", "--optimizer", "adagrad"], 6),  # 5 + final
    (["--algorithm", "bmuf", "--sync-period", "4", "--warmup-steps", "2", "--optimizer", "radam"], 2 + 4),
    (["--algorithm", "bmuf", "--sync-period", "4", "--warmup-steps", "0", "--moment-sync", "reset",
      "--optimizer", "adam", "--no-nesterov", "--block-momentum", "0.5"], 4),
    (["--algorithm", "easgd", "--sync-period", "5", "--beta", "0.5", "--optimizer", "adadelta"], 4),  # 3 + final
    (["--algorithm", "admm", "--local-steps", "8", "--rho", "0.5", "--sgd-nesterov"], 2),
])
def test_every_algorithm_and_optimizer_runs(capsys, tmp_path, blobs, argv, syncs):
    metrics = tmp_path / "m" / "metrics.json"
    assert main([*argv, "--dataset", blobs, "--epochs", "2", "--batch-size", "8", "--metrics-json", str(metrics),
                 *FAST]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 16 and summary["syncs"] == syncs, summary
    assert "epoch   2/2  train_loss" in out and "test_acc" in out and "syncs" in out and "bytes_sent" in out
    saved = json.load(open(metrics))
    assert [e["epoch"] for e in saved["epochs"]] == [1, 2] and saved["summary"] == summary


def test_resume_with_other_options_is_refused(capsys, tmp_path, blobs):
    ck = str(tmp_path / "ck")
    assert main(["--dataset", blobs, "--epochs", "1", "--batch-size", "8", "--checkpoint-dir", ck, *FAST]) == 0
    capsys.readouterr()
    err = error_of(capsys, ["--dataset", blobs, "--epochs", "2", "--batch-size", "8", "--lr", "0.2",
                            "--checkpoint-dir", ck, "--resume", *FAST])
    assert "--resume: the checkpoint was made with different options: lr was None, now 0.2" in err
    err = error_of(capsys, ["--dataset", blobs, "--checkpoint-dir", str(tmp_path / "empty"), "--resume", *FAST])
    assert "no checkpoint in" in err


def _checkpointed_run(tmp_path):
    ck = str(tmp_path / "ck")
    rc, out = run_under_mpi(2, ["-m", "pycomm.tools.train", "--epochs", "1", "--batch-size", "64", "--checkpoint-dir", ck,
                                *FAST], timeout=240)
    assert rc == 0, out
    step = open(os.path.join(ck, "latest")).read().strip()
    return ck, os.path.join(ck, f"step{int(step):09d}-rank1.pt")


def test_checkpoint_missing_or_corrupt_on_one_rank_ends_the_job(tmp_path):
    # Only rank 1's file is damaged: every rank must stop, naming rank 1, its file and the cause.
    ck, rank1 = _checkpointed_run(tmp_path)
    good = open(rank1, "rb").read()
    resume = ["-m", "pycomm.tools.train", "--epochs", "2", "--batch-size", "64", "--checkpoint-dir", ck, "--resume", *FAST]
    with open(rank1, "wb") as f:
        f.write(good[: len(good) // 2])  # truncated, as by a full disk
    rc, out = run_under_mpi(2, resume, timeout=120)
    assert rc == 2, out
    assert f"rank 1: checkpoint {rank1} is corrupt or truncated" in out, out
    assert "rank 0:" not in out and "Traceback" not in out, out
    os.remove(rank1)
    rc, out = run_under_mpi(2, resume, timeout=120)
    assert rc == 2, out
    assert f"rank 1: checkpoint {rank1} is missing" in out, out


class _Payload:
    """Unpickling this runs os.system: what a hostile checkpoint would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_with_a_pickled_callable_is_refused(tmp_path):
    import torch

    import pycomm
    from pycomm.tools.train import checkpoint

    pycomm.init()
    ck, marker = tmp_path / "ck", tmp_path / "code-ran"
    ck.mkdir()
    torch.save({"loop": {"epoch": 1}, "evil": _Payload(str(marker))}, str(ck / f"step{7:09d}-rank0.pt"))
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(str(ck), 7)
    assert f"checkpoint {ck / f'step{7:09d}-rank0.pt'} holds something other than tensors" in str(e.value)
    assert "posix.system" in str(e.value) or "os.system" in str(e.value), str(e.value)
    assert not marker.exists()
    # What pycomm itself saves still loads.
    torch.save({"t": torch.arange(3), "rng": torch.get_rng_state(), "h": [{"a": 1.5, "b": None}], "s": "x"},
               str(ck / f"step{8:09d}-rank0.pt"))
    assert checkpoint.load(str(ck), 8)["h"] == [{"a": 1.5, "b": None}]


def test_warmup_longer_than_the_run_warns(tmp_path, blobs, capsys):
    # 2 epochs x 8 steps = 16 steps, BMUF's default warm-up is 500: the run would be plain SSGD.
    with pytest.warns(UserWarning, match=r"--warmup-steps is 500 but the run has only 16 steps"):
        assert main(["--algorithm", "bmuf", "--dataset", blobs, "--epochs", "2", "--batch-size", "8", *FAST]) == 0
    with pytest.warns(UserWarning, match=r"--warmup-steps is 16 but the run has only 16 steps"):
        assert main(["--algorithm", "bmuf", "--warmup-steps", "16", "--dataset", blobs, "--epochs", "2",
                     "--batch-size", "8", *FAST]) == 0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["--algorithm", "bmuf", "--warmup-steps", "15", "--dataset", blobs, "--epochs", "2",
                     "--batch-size", "8", *FAST]) == 0


def test_optimizer_and_precision_option_errors(capsys):
    err = error_of(capsys, ["--algorithm", "bmuf", "--optimizer", "onebit_adam"])
    assert ("--optimizer onebit_adam is the whole data-parallel step (it averages gradients, then 1-bit compressed "
            "momenta, itself); use it with --algorithm ssgd, not bmuf") in err
    err = error_of(capsys, ["--optimizer", "lamb", "--freeze-step", "5"])
    assert "--freeze-step applies to onebit_adam and onebit_lamb, not to lamb" in err
    err = error_of(capsys, ["--optimizer", "onebit_lamb", "--freeze-step", "-1"])
    assert "--freeze-step must be >= 0, got -1" in err
    err = error_of(capsys, ["--optimizer", "onebit_adam", "--compression", "onebit"])
    assert "--optimizer onebit_adam compresses its momentum itself; --compression onebit does not apply" in err
    err = error_of(capsys, ["--algorithm", "easgd", "--precision", "fp16"])
    assert "--precision fp16 applies to --algorithm ssgd (pycomm.optim.MixedPrecision reduces the gradients), " \
           "not to easgd" in err
    err = error_of(capsys, ["--precision", "bf16", "--compression", "fp16"])
    assert "--precision bf16 reduces the gradients in bf16 already; --compression fp16 does not apply" in err
    err = error_of(capsys, ["--precision", "fp8"])
    assert "invalid choice: 'fp8'" in err
    err = error_of(capsys, ["--optimizer", "lamb", "--momentum", "0.9"])
    assert "--momentum applies to sgd, rmsprop and lars, not to lamb" in err


@pytest.mark.parametrize("argv", [
    ["--optimizer", "lars"],
    ["--optimizer", "lamb", "--weight-decay", "0.01"],
    # 3/4 of the run as warm-up: an element whose gradient was exactly 0 through the warm-up (a dead ReLU unit) has
    # v = 0 and then steps by m / eps when it revives (DeepSpeed's frozen variance does the same); with 16 or 32
    # warm-up steps that happens here and the run ends in NaN (measured)
    ["--optimizer", "onebit_adam", "--freeze-step", "48"],
    ["--optimizer", "onebit_lamb", "--freeze-step", "48"],  # the same with LAMB (measured: 9 warm-up steps end in NaN)
    ["--optimizer", "sgd", "--precision", "fp16"],
    ["--optimizer", "lars", "--precision", "bf16"],
    ["--optimizer", "lamb", "--precision", "fp16", "--model", "cnn"],
    # fp16 with the same 3/4 warm-up: after 16 warm-up steps the run sits on the same edge, CPU by CPU (measured on
    # an AMD EPYC with torch 2.13.0: freeze 8 -> 56% test accuracy, 16 -> 37.5% after 10 overflow skips and a
    # train loss of 50, 24 -> NaN, 32 -> 62.5%, 48 -> 68.75% with no skip; another machine passed at 16)
    ["--optimizer", "onebit_lamb", "--precision", "fp16", "--freeze-step", "48"],
])
def test_new_optimizers_and_precisions_train(capsys, tmp_path, blobs, argv):
    """1 rank, 64 well-separated samples, 8 epochs of batch 8: every combination learns the blobs."""
    assert main([*argv, "--dataset", blobs, "--epochs", "8", "--batch-size", "8", *FAST]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 64 and summary["syncs"] == 64, summary
    precision = argv[argv.index("--precision") + 1] if "--precision" in argv else "fp32"
    assert summary["precision"] == precision
    if "onebit" in argv[1]:
        assert summary["freeze_step"] == int(argv[argv.index("--freeze-step") + 1])
        assert "freeze_step" in out.splitlines()[0]
    if precision != "fp32":
        # fp16 starts at scale 2^16 and halves on each (rank-agreed) overflow; 64 steps < growth_interval 2000.
        # bf16 keeps scale 1 and never overflows here.
        skipped = summary["skipped_steps"]
        assert summary["loss_scale"] == (2.0 ** (16 - skipped) if precision == "fp16" else 1.0), summary
        assert skipped < 16 if precision == "fp16" else skipped == 0, summary
        assert f"{precision} model with float32 master weights" in out
    # the classes are 1 apart on every input (std 1); 3 classes: chance is 33%. 
    assert summary["final_test_accuracy"] > 50, summary


def test_onebit_adam_sends_less_than_adam_after_warmup():
    """2 ranks: onebit_adam's bytes = warm-up steps at float32 + compressed steps at about 1/32 of that."""
    sent = {}
    for opt in ("adam", "onebit_adam"):
        rc, out = run_under_mpi(2, ["-m", "pycomm.tools.train", "--optimizer", opt, "--dataset", "synthetic", "--epochs", "2",
                                    "--batch-size", "64", *FAST], timeout=240)
        assert rc == 0, out
        sent[opt] = summary_of(out)
    steps = sent["adam"]["steps"]  # 4096 samples, 2048 per rank, batch 64: 32 steps per epoch
    assert sent["onebit_adam"]["steps"] == steps == 64
    assert sent["onebit_adam"]["freeze_step"] == 9  # default: 15% of the run's steps
    per_step = sent["adam"]["bytes_sent"] / steps
    # 9 float32 steps, then 55 steps of the 1-bit wire format (1 bit per element plus scales, both phases):
    # about 1/32 of a float32 step each
    assert 9 * per_step < sent["onebit_adam"]["bytes_sent"] < 9 * per_step + 55 * per_step / 16, sent
    assert sent["onebit_adam"]["final_test_accuracy"] > 80, sent  # 10 classes: chance is 10%


def run_mp(tmp, *extra):
    args = ["-m", "pycomm.tools.train", "--optimizer", "lamb", "--precision", "fp16", "--epochs", "2", "--batch-size",
            "64", *FAST, *extra]
    return run_under_mpi(2, args, timeout=240)


def test_mixed_precision_killed_and_resumed_is_bitwise_identical(tmp_path):
    # 2 ranks, 12 steps per epoch, 24 in all; the loss scale, the masters and LAMB's moments are in the checkpoint
    rc, out = run_mp(tmp_path, "--checkpoint-dir", str(tmp_path / "a"))
    assert rc == 0, out
    whole = summary_of(out)
    ck = str(tmp_path / "b")
    rc, out = run_mp(tmp_path, "--checkpoint-dir", ck, "--checkpoint-every", "5", "--crash-at-step", "17")
    assert rc != 0 and "{" not in out, out
    rc, out = run_mp(tmp_path, "--checkpoint-dir", ck, "--checkpoint-every", "5", "--resume")
    assert rc == 0, out
    assert "(global step 15)" in out
    resumed = summary_of(out)
    for key in ("model_sha256", "final_train_loss", "final_test_accuracy", "syncs", "bytes_sent", "steps",
                "loss_scale", "skipped_steps"):
        assert resumed[key] == whole[key], key
