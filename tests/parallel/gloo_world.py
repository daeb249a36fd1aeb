"""torch.distributed over gloo on the MPI ranks of a test job, as a reference beside pycomm."""
import socket

import torch.distributed as dist


def start_gloo() -> None:
    """init_process_group("gloo") on MPI.COMM_WORLD's ranks: rank 0 picks a free port, mpi4py broadcasts it."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if dist.is_initialized():
        return
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
