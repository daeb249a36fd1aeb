"""The CI slice of bench/matrix.py: every algorithm once (with sgd) and every optimizer once (with ssgd), at
pycomm-train's defaults on digits at 4 ranks, 2 epochs instead of 5, seed 0, in one mpirun job
(tests/train_slice.py).

Cost: about 2 minutes on a 2-core machine shared with other jobs (one job start of about 60 s under that
load, then 20 runs of 1-3 s each); docs/training-defaults.md §5.
"""
import json

import pytest

from mpi_launch import run_under_mpi

# Measured: `pycomm-run -np 4 -- python tests/train_slice.py --epochs 2 --seeds 0 1 2`, three times.
# Synchronous runs are deterministic per seed: lowest final test accuracy over the 3 seeds at today's defaults
# 57.4% (ec_dnn), everything else >= 76.3 (56.3% lars and 73.0 admm before lars adapted the biases and admm's
# rho became 0.1); seed 0's lowest is 66.6 (ec_dnn). Chance is 10%.
SYNC_MIN_ACCURACY = 50.0
# The parameter-server runs are not reproducible (push order): their final test accuracy (the model at one
# instant) spread 29.2-84.1% over 36 runs, too wide to bound, but their final training loss (epoch 2's
# mean over every step of every rank) stayed at 1.04-1.63. Not learning is ln 10 = 2.303: with the servers'
# lr not divided by the workers (the bug this guards) asgd ended at 2.32.
ASYNC_MAX_LOSS = 2.0


@pytest.mark.mpi
def test_every_algorithm_and_optimizer_learns_at_defaults():
    rc, out = run_under_mpi(4, ["tests/train_slice.py", "--epochs", "2", "--seeds", "0"], timeout=600)
    assert rc == 0, out[-6000:]
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith('{"run"')]
    from pycomm.training import names, server_sgd
    from pycomm.tools.train.optimizers import OPTIMIZERS

    assert [r["run"] for r in rows] == [f"algorithm {a}" for a in names()] + [
        f"optimizer {o}" for o in OPTIMIZERS if o != "sgd"], out[-6000:]
    for r in rows:
        kind, name = r["run"].split()
        if kind == "algorithm" and name in server_sgd() and name != "hybrid":  # hybrid on one node: one group, SSGD
            assert r["final_loss"] <= ASYNC_MAX_LOSS, r
        else:
            assert r["accuracy"] >= SYNC_MIN_ACCURACY, r
