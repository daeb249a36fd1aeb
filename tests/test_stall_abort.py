"""PYCOMM_STALL_ABORT_S ends a job whose ranks stopped matching, with a message naming them."""
import os
import textwrap

from mpi_launch import run_under_mpi

SCRIPT = textwrap.dedent("""
    import time, torch, pycomm
    pycomm.init()
    if pycomm.rank() == 1:
        time.sleep(120)          # never joins in time
    pycomm.allreduce(torch.ones(4), name="stuck.grad")
""")


def test_stalled_job_is_aborted(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(SCRIPT)
    rc, out = run_under_mpi(2, [str(script)], timeout=100,
                            env={"PYCOMM_STALL_WARNING_S": "1", "PYCOMM_STALL_ABORT_S": "3"})
    assert rc != 0, out
    assert "rank 1 has not submitted it" in out, out
    assert "'stuck.grad'" in out and "Aborting the job" in out, out
