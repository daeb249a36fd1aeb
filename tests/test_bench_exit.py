"""bench/allreduce.py fails loudly: only algorithms the topology cannot run are skipped,
and any other CommError, or a wrong result, makes it exit non-zero."""
import os

import pytest

from mpi_launch import ROOT, run_under_mpi

BENCH = os.path.join(ROOT, "bench", "allreduce.py")
ARGS = ["--min-bytes", "1K", "--max-bytes", "4K", "--baselines", "", "--iters", "2", "--warmup", "0"]


@pytest.mark.mpi
def test_unavailable_algorithm_is_skipped_and_the_rest_runs():
    rc, out = run_under_mpi(2, [BENCH, *ARGS, "--algorithms", "ring,shm", "--ranks-per-node", "1"], timeout=120)
    assert rc == 0, out
    assert "# skipping shm: shm reduces within one node and this job spans 2" in out, out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("  ") and " ring " in ln]
    assert len(rows) == 2 and all(r[7] == "0" for r in rows), out  # 1 KiB and 4 KiB, no wrong element


@pytest.mark.mpi
def test_comm_error_while_timing_fails_the_run():
    # Ranks that disagree on the call raise CommError inside the timed allreduce:
    # that is a failure, not a "skipping" line.
    rc, out = run_under_mpi(2, [BENCH, *ARGS, "--algorithms", "ring"], timeout=120,
                            env={"PYCOMM_TEST_BENCH_DISAGREE": "1"})
    assert rc != 0, out
    assert "ranks disagree on the call" in out and "skipping" not in out, out


GPU_BENCH = os.path.join(ROOT, "bench", "gpu_allreduce.py")


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["PYCOMM_FORCE_STAGING", "PYCOMM_FORCE_DEVICE_DIRECT"])
def test_gpu_allreduce_checks_values(path):
    """bench/gpu_allreduce.py's CPU dry run of a device path: every row runs every compression without
    an error and its values check out (none and fp16 against mpi4py's float64 average, onebit against
    the numpy two-phase reference)."""
    rc, out = run_under_mpi(2, [GPU_BENCH, "--device", "cpu", "--min-bytes", "64K", "--max-bytes", "256K",
                                "--iters", "3"], timeout=180, env={path: "1"})
    assert rc == 0, out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("64 KiB", "256 KiB"))]
    assert len(rows) == 2, out
    assert all(r[-1] == "ok" and "error" not in r for r in rows), out
    assert "onebit up to 64 MiB" in out, out


@pytest.mark.mpi
def test_stages_show_where_each_algorithms_time_goes(tmp_path):
    """--stages: per algorithm and size, the stages that algorithm marks (ring: reduce and MPI; shm:
    the copies, the reduction and its barriers) and the rest of the call, which add up to the call."""
    out_json = tmp_path / "stages.json"
    rc, out = run_under_mpi(2, [BENCH, "--min-bytes", "64K", "--max-bytes", "256K", "--baselines", "",
                                "--algorithms", "ring,shm", "--iters", "3", "--warmup", "0", "--stages",
                                "--json", str(out_json)], timeout=120)
    assert rc == 0, out
    assert "where the time goes" in out, out
    import json

    breakdown = json.loads(out_json.read_text())["stages"]
    assert [(b["impl"], b["size"]) for b in breakdown] == [("ring", 64 << 10), ("shm", 64 << 10),
                                                           ("ring", 256 << 10), ("shm", 256 << 10)], breakdown
    marked = {"ring": {"reduce", "mpi"}, "shm": {"copy_in", "reduce", "copy_out", "barrier"}}
    for b in breakdown:
        us = {r["stage"]: r["us"] for r in b["stages"]}
        assert {s for s, t in us.items() if t > 0 and s != "other"} == marked[b["impl"]], b
        assert abs(sum(us.values()) - b["call_us"]) < 1e-6 * b["call_us"], b  # 'other' is the remainder
        assert us["other"] > 0, b  # the queue and coordination round take some time on every call
