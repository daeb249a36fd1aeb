"""Allreduce, broadcast and allgather of CUDA tensors against the same calls on CPU copies.

    mpirun -np 2 python bench/gpu_staged_check.py      # ranks may share one GPU

Without a CUDA-aware MPI, device tensors travel through the staging pipeline
(pinned host chunks on two CUDA streams). Every result must equal the CPU
result bitwise (with two ranks each element is one addition, a + b, whatever the
chunking). Prints one line per
case and exits non-zero on any mismatch.
"""
import sys
import time

import torch

import pycomm


def main():
    pycomm.init()
    rank, size = pycomm.rank(), pycomm.size()
    dev = torch.device("cuda", pycomm.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    bad = 0
    pycomm.set_options(staging_chunk_bytes=1 << 20)
    for count in (1, 1001, (1 << 20) + 7, 16 << 20):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            g = torch.Generator().manual_seed(1000 * rank + count)
            host = (torch.rand(count, generator=g, dtype=torch.float64) * 100).to(dtype)
            for op in ("sum", "max") + (("avg",) if dtype.is_floating_point else ()):
                want = pycomm.allreduce(host.clone(), op=op, algorithm="ring")
                d = host.to(dev)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                got = pycomm.allreduce(d, op=op, algorithm="ring")
                dt = time.perf_counter() - t0
                ok = torch.equal(got.cpu(), want)
                bad += not ok
                if rank == 0:
                    print(f"allreduce {op:>3} {str(dtype):>15} [{count:>9}] {'ok' if ok else 'MISMATCH'} "
                          f"{count * host.element_size() / dt / 1e9:7.2f} GB/s algbw (staged)", flush=True)
    x = torch.full((1000,), float(rank), device=dev)
    pycomm.broadcast(x, root=size - 1)
    bad += not torch.equal(x.cpu(), torch.full((1000,), float(size - 1)))
    y = pycomm.allgather(torch.full((rank + 1, 3), float(rank), device=dev))
    bad += not (y.device == dev and y.shape == (size * (size + 1) // 2, 3))
    if rank == 0:
        print(f"broadcast/allgather on {dev}: {'ok' if bad == 0 else 'MISMATCH'}; mpi_cuda_aware="
              f"{pycomm._C.mpi_cuda_aware()}")
    from mpi4py import MPI

    bad = MPI.COMM_WORLD.allreduce(bad)
    pycomm.shutdown()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
