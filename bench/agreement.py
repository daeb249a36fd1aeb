"""What the cross-rank agreement check costs on small allreduces.

    pycomm-run -np 4 python bench/agreement.py

Times a blocking allreduce (algorithm "mpi") of small tensors with the
coordination round (the default: two small point-to-point messages per rank
that check the ranks agree and let them fuse) and without it (check off and
fusion off: then nothing is coordinated), and MPI's own Allreduce through
mpi4py beside them. Medians of the slowest rank.
"""
import argparse

import numpy as np
import torch

import pycomm
from pycomm.tools.benchmark import median_time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=300)
    args = p.parse_args(argv)
    pycomm.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(f"# {comm.size} ranks; blocking allreduce, algorithm mpi; median of the slowest rank (us)")
        print(f"  {'bytes':>7} {'checked':>10} {'unchecked':>10} {'mpi4py':>10} {'check cost':>11}")
    for nbytes in (4, 64, 1024, 16384):
        x = torch.ones(nbytes // 4)
        a = np.ones(nbytes // 4, dtype=np.float32)
        t = {}
        defaults = pycomm.get_options()
        for check in (True, False):
            pycomm.set_options(check_consistency=check,
                               fusion_threshold_bytes=defaults["fusion_threshold_bytes"] if check else 0)
            t[check] = median_time(lambda: pycomm.allreduce(x, algorithm="mpi"), comm, args.iters, warmup=10)
        pycomm.set_options(check_consistency=True, fusion_threshold_bytes=defaults["fusion_threshold_bytes"])
        base = median_time(lambda: comm.Allreduce(MPI.IN_PLACE, a), comm, args.iters, warmup=10)
        if comm.rank == 0:
            print(f"  {nbytes:>7} {t[True] * 1e6:>10.1f} {t[False] * 1e6:>10.1f} {base * 1e6:>10.1f} "
                  f"{(t[True] - t[False]) * 1e6:>+10.1f}")
    pycomm.shutdown()


if __name__ == "__main__":
    main()
