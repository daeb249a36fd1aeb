"""Timing helpers shared by pycomm's benchmarks, pycomm-tune and pycomm-train's bandwidth table.

Every timing is collective: all ranks call with the same arguments. One
sample = barrier, run, then the slowest rank's time (MPI MAX). Reports use
medians of samples and nccl-tests' definitions: algbw = S / t and
busbw = algbw * 2(N-1)/N.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional, Tuple


def slowest_rank_times(fn: Callable[[], None], comm, iters: int, warmup: int = 1,
                       before: Optional[Callable[[], None]] = None) -> List[float]:
    """Seconds per iteration of `fn`, each the slowest rank's; `before` runs untimed ahead of each."""
    from mpi4py import MPI

    times = []
    for i in range(warmup + iters):
        if before is not None:
            before()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= warmup:
            times.append(dt)
    return times


def median_time(fn: Callable[[], None], comm, iters: int, warmup: int = 1,
                before: Optional[Callable[[], None]] = None) -> float:
    return statistics.median(slowest_rank_times(fn, comm, iters, warmup, before))


def bandwidth(nbytes: int, seconds: float, world_size: int) -> Tuple[float, float]:
    """(algbw, busbw) in GB/s for an allreduce of `nbytes` taking `seconds` on `world_size` ranks."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * 2 * (world_size - 1) / world_size


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes of a size written like 64M, 4KiB, 1G or 4096."""
    t = text.strip().upper().rstrip("B").rstrip("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        return int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64K, 16M, 1G)") from None


def human_size(n: int) -> str:
    """64 MiB, 4 KiB, or bytes where the size is not a whole number of KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def init_torch_process_group(comm, backend: str = "gloo") -> None:
    """torch.distributed's init_process_group(backend) on `comm`'s ranks of one host, the reference that
    pycomm's benchmarks and tests compare with: rank 0 picks a free local port, `comm` broadcasts it.
    Does nothing if a default group exists already."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)

