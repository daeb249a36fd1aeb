"""Plain mpi4py across the test bed (no pycomm): hosts as MPI sees them, and an Allreduce whose bytes must
cross the shaped link. Rank 0 prints ``MPI-PROBE <json>``. Used to check an MPI flavour's launch flags."""
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
from mpi4py import MPI


def host_sent():
    out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True, check=True)
    return int(re.search(r"root.*?\n\s*Sent (\d+) bytes", out.stdout, re.S).group(1))


def main():
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    nbytes = int(os.environ.get("PYCOMM_MULTIHOST_LINK_BYTES", 8 << 20))
    x = np.full(nbytes // 8, comm.rank + 1.0)
    y = np.empty_like(x)
    comm.Allreduce(x, y)  # connections up
    comm.Barrier()
    before = host_sent() if local.rank == 0 else 0
    comm.Barrier()
    comm.Allreduce(x, y)
    comm.Barrier()
    sent = host_sent() - before if local.rank == 0 else None
    report = {
        "library": MPI.Get_library_version().splitlines()[0].strip(),
        "hosts": comm.allgather(socket.gethostname()),
        "local_sizes": comm.allgather(local.size),
        "correct": bool(comm.allreduce(bool(np.all(y == comm.size * (comm.size + 1) / 2)), op=MPI.LAND)),
        "sent_by_host": [s for s in comm.allgather(sent) if s is not None],
        "bytes": nbytes,
    }
    if comm.rank == 0:
        print("MPI-PROBE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
