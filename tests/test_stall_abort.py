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
    # Rank 1's engine answered the coordinator's question: alive, outside pycomm.
    assert "Rank 1 is alive: its pycomm engine has been idle for" in out, out
    assert "so it is outside pycomm (computing, or in another library's call)" in out, out


BUSY = textwrap.dedent("""
    import time, torch, pycomm
    pycomm.init()
    pycomm.allreduce(torch.ones(4), name="first")
    if pycomm.rank() == 2:
        time.sleep(120)
    pycomm.allreduce(torch.ones(4), name="second")
""")


def test_default_abort_ends_a_real_deadlock():
    import pycomm.runtime

    # The default must end a deadlock on its own (600 s, as torch.distributed's
    # default collective timeout) while leaving room for long evaluations on one rank.
    assert pycomm.runtime.OPTIONS["stall_abort_s"][2] == 600.0
    assert pycomm.runtime.OPTIONS["stall_warning_s"][2] == 60.0


def test_stall_report_names_the_last_operation(tmp_path):
    script = tmp_path / "busy.py"
    script.write_text(BUSY)
    rc, out = run_under_mpi(3, [str(script)], timeout=100,
                            env={"PYCOMM_STALL_WARNING_S": "1", "PYCOMM_STALL_ABORT_S": "4"})
    assert rc != 0, out
    assert "rank 2 has not submitted it" in out and "ranks 0,1 are waiting" in out, out
    assert "Rank 2 is alive" in out and "its last operation was allreduce 'first'" in out, out
    assert "(seen from rank 1)" in out, out
