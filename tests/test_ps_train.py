"""pycomm-train's parameter-server algorithms with dedicated server ranks (pycomm-run --servers K).

The last K ranks only serve; the workers train on the data sharded over the
workers alone and report. Launched under mpirun like the fault tests.
"""
import json

import pytest

from mpi_launch import run_under_mpi


def _train(np_, servers, algorithm, *extra, epochs=1, lr=0.1):
    args = ["-m", "pycomm.tools.train", "--algorithm", algorithm, "--dataset", "digits", "--model", "mlp",
            "--epochs", str(epochs), "--batch-size", "32", "--lr", str(lr), "--seed", "3", "--no-progress",
            "--no-bandwidth-table", *extra]
    rc, out = run_under_mpi(np_, args, timeout=180, env={"PYCOMM_PS_SERVERS": str(servers)})
    summaries = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{") and '"algorithm"' in ln]
    return rc, out, summaries


@pytest.mark.mpi
def test_ssp_bsp_with_two_dedicated_servers_matches_colocated():
    # s = 0 is BSP: 2 workers with 2 dedicated servers (4 ranks) train the same trajectory as 2 co-located
    # ranks; only the order in which a server applies the two workers' pushes of a step differs (float rounding).
    from pycomm.tools.train.data import load_dataset, steps_per_epoch
    from pycomm.tools.train.models import build_model

    runs = [_train(np_, k, "ssp", "--staleness", "0", lr=0.01) for np_, k in ((4, 2), (2, 0))]
    for rc, out, summaries in runs:
        assert rc == 0, out
        assert len(summaries) == 1, out  # rank 0, a worker, prints the summary; the servers print nothing
    out = runs[0][1]
    ded, colo = runs[0][2][0], runs[1][2][0]
    assert ded["world_size"] == 4 and ded["workers"] == 2 and ded["servers"] == 2, ded
    assert "(2 workers, 2 dedicated server rank(s))" in out, out
    d = load_dataset("digits")
    # The training data is split over the 2 workers only.
    assert ded["steps"] == colo["steps"] == steps_per_epoch(len(d.y_train), 2, 32), (ded, colo)
    # Every step of both workers reached the servers: one update per step, tensor and server holding part of it.
    shards = sum(min(p.numel(), 2) for p in build_model("mlp", d.input_shape, d.num_classes).parameters())
    assert sum(ded["staleness_histogram"]) == 2 * ded["steps"] * shards, ded
    # Final train loss of three such runs (2 co-located, 1 with one dedicated server): 2.275938, 2.275949,
    # 2.275958, a 9e-6 relative spread from the push order; 2e-4 leaves margin. Anything but the same BSP
    # trajectory on the same data shards (a missed push is caught by the count above) leaves it.
    rel = abs(ded["final_train_loss"] - colo["final_train_loss"]) / colo["final_train_loss"]
    assert rel < 2e-4, (ded["final_train_loss"], colo["final_train_loss"])
