"""The shm allreduce in one pass against chunk by chunk, for several chunk sizes, beside the ring and
MPI's own Allreduce (mpi4py) in the same run.

    pycomm-run -np 2 python bench/shm_chunk.py [--sizes 4M,16M,64M] [--chunks 0,512K,768K,1M,2M] [--reps 7]

`shm_chunk_bytes=0` is the one-pass form (a window the size of the message); any other value runs
messages above pycomm._C.shm_pipeline_min_bytes (the larger of the chunk and last-level cache /
2L) chunk by chunk through a window of two chunks (csrc/comm/shm_allreduce.cpp). Every
implementation is timed in turn within each repetition (float32, sum); a sample is the slowest
rank's time of one call; printed: the median in ms and its speed-up over mpi4py's Allreduce.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import pycomm
from pycomm.tools.benchmark import human_size, parse_size, slowest_rank_times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4M,16M,64M")
    p.add_argument("--chunks", default="0,512K,768K,1M,2M")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    pycomm.init()
    from mpi4py import MPI

    comm = pycomm.world_comm()
    if pycomm.num_nodes() > 1 or pycomm.size() < 2:
        raise SystemExit("bench/shm_chunk.py: the shm allreduce needs one node of at least 2 ranks")
    old = pycomm.get_options()["shm_chunk_bytes"]
    chunks = [parse_size(c) for c in args.chunks.split(",")]
    names = [f"shm {human_size(c) if c else 'one pass'}" for c in chunks] + ["ring", "mpi4py"]
    if comm.rank == 0:
        print(f"# {comm.size} ranks on one node; median of {args.reps}, ms per call (speed-up over mpi4py); "
              f"chunked above: " + ", ".join(f"{human_size(c)}: {human_size(pycomm._C.shm_pipeline_min_bytes(comm.size, c))}"
                                             for c in chunks if c))
        print("| size | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
    for size in (parse_size(s) for s in args.sizes.split(",")):
        x = torch.ones(size // 4)
        y = x.numpy()
        runs = {}
        for c, name in zip(chunks, names):
            runs[name] = (lambda c=c: pycomm.set_options(shm_chunk_bytes=c),
                          lambda: pycomm.allreduce(x, algorithm="shm"))
        runs["ring"] = (None, lambda: pycomm.allreduce(x, algorithm="ring"))
        runs["mpi4py"] = (None, lambda: comm.Allreduce(MPI.IN_PLACE, y, op=MPI.SUM))
        samples = {n: [] for n in names}
        for _ in range(args.reps):
            for name in names:
                setup, fn = runs[name]
                if setup:
                    setup()
                fn()  # the window at this form's size
                samples[name] += slowest_rank_times(fn, comm, iters=1, warmup=0)
        med = {n: statistics.median(s) for n, s in samples.items()}
        if comm.rank == 0:
            print(f"| {human_size(size)} | " + " | ".join(f"{med[n] * 1e3:.2f} ({med['mpi4py'] / med[n]:.2f}x)"
                                                       for n in names) + " |", flush=True)
    pycomm.set_options(shm_chunk_bytes=old)
    pycomm.shutdown()


if __name__ == "__main__":
    main()
