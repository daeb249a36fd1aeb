"""torch.distributed default groups on the MPI ranks of a test job: over "pycomm", the backend under test,
and over gloo, the reference beside it.

Several test files share one process under tests/test_parallel.py, so each world is made for a block and
destroyed after it: the next file must find no default group left behind.
"""
import contextlib


@contextlib.contextmanager
def pycomm_world():
    """init_process_group("pycomm") for the block. The rendezvous is taken afresh (a new port agreed over
    MPI, pycomm.distributed.bootstrap_env): a second env:// rendezvous on the port of the first could reach
    the first's store on rank 0 before that rank has destroyed it."""
    import torch.distributed as dist

    import pycomm.distributed

    pycomm.distributed.bootstrap_env(force=True)
    dist.init_process_group("pycomm")
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def gloo_world():
    """init_process_group("gloo") on MPI.COMM_WORLD's ranks (pycomm.tools.benchmark.init_torch_process_group)
    for the block."""
    import torch.distributed as dist
    from mpi4py import MPI

    from pycomm.tools.benchmark import init_torch_process_group

    init_torch_process_group(MPI.COMM_WORLD, "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
