"""The guard before CUDA device pointers go to MPI (comm/memory_mover.h: direct_path_refusal).

The engine asks it, after the coordination round and before any data moves, wherever device memory
would be handed to MPI directly: a forced direct path (force_device_direct) under an MPI that cannot
read device memory, or PYCOMM_CUDA_AWARE=1 claimed for a library whose headers say it was built
without CUDA. Every rank has agreed on the tensor's device and the options by then, so every rank
raises the same CommError. These cases run the verdict itself on every input; on a GPU machine
tests/parallel/test_staging.py::test_forced_direct_cuda_refused runs it through the engine.
"""
import pytest

from pycomm import _C


def refusal(cuda_aware, forced, library, override=""):
    return _C._direct_path_refusal("allreduce of 'g'", cuda_aware, forced, library, override)


@pytest.mark.parametrize("library", [-1, 0, 1])
def test_forced_direct_without_cuda_aware_mpi_is_refused(library):
    why = refusal(cuda_aware=False, forced=True, library=library)
    assert why.startswith("allreduce of 'g': force_device_direct (PYCOMM_FORCE_DEVICE_DIRECT=1) hands CUDA device")
    assert "cannot read device memory" in why and "unset force_device_direct" in why


def test_override_against_a_library_built_without_cuda_is_refused():
    why = refusal(cuda_aware=True, forced=False, library=0, override="1")
    assert "PYCOMM_CUDA_AWARE=1 declares this MPI CUDA-aware" in why
    assert "built without CUDA" in why and "unset PYCOMM_CUDA_AWARE" in why
    # Forced as well: the same reason (the override is what made the MPI look CUDA-aware).
    assert refusal(cuda_aware=True, forced=True, library=0, override="1") == why


@pytest.mark.parametrize("library,override", [(1, ""), (1, "1"), (-1, "1"), (-1, "")])
def test_cuda_aware_mpi_passes(library, override):
    # A library that says it is CUDA-aware, or one that cannot tell (the override is then trusted).
    assert refusal(cuda_aware=True, forced=False, library=library, override=override) == ""
    assert refusal(cuda_aware=True, forced=True, library=library, override=override) == ""


def test_library_support_of_this_build():
    support = _C.mpi_library_cuda_support()
    assert support in (-1, 0, 1)
    # The override never changes what the library says of itself.
    if support == 0:
        assert refusal(_C.mpi_cuda_aware(), False, support, "1") != ""


def test_stats_and_check_build_say_which_device_path():
    import os
    import subprocess
    import sys

    import pycomm
    from pycomm.runtime import device_path

    pycomm.init()
    # One process has no peers inside its node: the peer path is refused for the job's shape.
    expected = "staged: one rank" if not _C.mpi_cuda_aware() else device_path()
    assert pycomm.stats()["device_path"] == expected
    env = {k: v for k, v in os.environ.items() if k != "PYCOMM_CUDA_AWARE"}

    def check_build(**extra):
        out = subprocess.run([sys.executable, "-m", "pycomm.tools.launcher", "--check-build", "-np", "2"],
                             capture_output=True, text=True, timeout=300, env=dict(env, **extra))
        assert out.returncode == 0, out.stderr
        return [ln for ln in out.stdout.splitlines() if ln.startswith("device path")]

    line = check_build(PYCOMM_CUDA_AWARE="0")
    assert len(line) == 1 and line[0].split(None, 2)[2].startswith("peer or staged: "), line
    assert "probed at the first CUDA allreduce" in line[0], line
    line = check_build(PYCOMM_CUDA_AWARE="0", PYCOMM_PEER_PATH="0")
    assert len(line) == 1 and "staged: CUDA tensors through pinned host memory" in line[0], line
    if _C.mpi_library_cuda_support() == 0:  # the pip wheels: the override is refused, and said so
        line = check_build(PYCOMM_CUDA_AWARE="1")
        assert len(line) == 1 and "refused: CUDA tensors: PYCOMM_CUDA_AWARE=1 declares" in line[0], line
