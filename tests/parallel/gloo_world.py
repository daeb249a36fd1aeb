"""torch.distributed over gloo on the MPI ranks of a test job, as a reference beside pycomm."""


def start_gloo() -> None:
    """init_process_group("gloo") on MPI.COMM_WORLD's ranks (pycomm.tools.benchmark.init_torch_process_group)."""
    from mpi4py import MPI

    from pycomm.tools.benchmark import init_torch_process_group

    init_torch_process_group(MPI.COMM_WORLD, "gloo")
