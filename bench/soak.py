"""Resident memory over many small collectives: does pycomm grow per call?

    pycomm-run -np 2 python bench/soak.py 10000     # 2 x 10000 allreduces of 4 KiB after a warm-up

After a warm-up of 2,000 blocking and 2,000 asynchronous 4 KiB allreduces,
runs N of each (plus a broadcast and a small allgather every 1,000) and prints
every rank's VmRSS before and after. A per-call leak grows with N; allocator
settling does not.
"""
import sys
import time

import torch

import pycomm


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def calls(x: torch.Tensor, n: int) -> None:
    for i in range(n):
        pycomm.allreduce(x, op="avg")
        pycomm.allreduce_async(x, op="avg", name="a").wait()
        if i % 1000 == 0:
            pycomm.broadcast(x, root=0)
            pycomm.allgather(x[:3])


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
    pycomm.init()
    x = torch.ones(1024)  # 4 KiB
    calls(x, 2000)
    before, t = rss_kib(), time.time()
    calls(x, n)
    after = rss_kib()
    print(f"rank {pycomm.rank()}: rss {before} -> {after} KiB (+{after - before}) over {2 * n} allreduces "
          f"in {time.time() - t:.1f} s", flush=True)
    pycomm.shutdown()


if __name__ == "__main__":
    main()
