"""What the timeline costs when it is off, on a loop of 4 KiB allreduces.

    pycomm-run -np 2 python bench/timeline_cost.py [ITERS] [REPEATS]    # defaults 2000, 9

Times ITERS blocking 4 KiB (1024 float32) allreduces, REPEATS times, in three
states of one run: the timeline never started ("never"), stopped again after
running ("after stop": the hooks see the flag off, as in "never"), and on
(writing to a temporary file, for scale). Each repeat is timed between two
barriers; rank 0 prints the median microseconds per allreduce of each state
and the ratio after-stop / never, which should be 1 within the noise.
"""
import os
import statistics
import sys
import tempfile
import time

import torch

import pycomm


def loop(x: torch.Tensor, iters: int) -> float:
    pycomm.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        pycomm.allreduce(x, op="sum", name="cost")
    pycomm.barrier()
    return (time.perf_counter() - t) / iters * 1e6


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    pycomm.init()
    x = torch.ones(1024)
    for _ in range(3):  # warm-up: first calls, page faults, the other rank catching up
        loop(x, iters)
    never = [loop(x, iters) for _ in range(repeats)]
    with tempfile.TemporaryDirectory() as d:
        pycomm.start_timeline(os.path.join(d, "cost.json"))
        on = [loop(x, iters) for _ in range(repeats)]
        pycomm.stop_timeline()
    after = [loop(x, iters) for _ in range(repeats)]
    if pycomm.rank() == 0:
        m_never, m_after, m_on = (statistics.median(v) for v in (never, after, on))
        print(f"timeline_cost: {pycomm.size()} ranks, {iters} x 4 KiB allreduce, median of {repeats}: "
              f"never started {m_never:.2f} us/op, after stop {m_after:.2f} us/op (ratio {m_after / m_never:.3f}), "
              f"on {m_on:.2f} us/op (ratio {m_on / m_never:.3f})", flush=True)
    pycomm.shutdown()


if __name__ == "__main__":
    main()
