"""Runs on every rank of a job across the test bed; tests/multihost/test_multihost.py launches it.

Checks, for every allreduce algorithm x compression pycomm offers:
- the result against mpi4py's own Allreduce (float64/float32 for the exact
  forms; a tolerance for fp16/bf16), and for onebit on random data against the
  numpy model of the two-phase scheme (tests/parallel/compression_ref.py, fed
  with every rank's input gathered by mpi4py), and that every rank holds
  bitwise the same result;
- the bytes each host sent over its shaped link (its tbf qdisc counter, read
  by local rank 0 of the host inside its namespace) during one allreduce of
  LINK_BYTES bytes.

Rank 0 prints one line ``MULTIHOST-RESULT <json>``. Check failures are
reported there, not raised, so that all ranks keep running the same sequence
of collectives; an unexpected exception aborts the job.
"""
import hashlib
import json
import os
import socket
import subprocess
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "parallel"))  # compression_ref: the numpy two-phase model

import numpy as np  # noqa: E402
import torch  # noqa: E402

import pycomm  # noqa: E402
from pycomm import collectives  # noqa: E402
from pycomm.tools.testbed import parse_qdisc_bytes  # noqa: E402
from compression_ref import layout, onebit_model  # noqa: E402

LINK_BYTES = int(os.environ.get("PYCOMM_MULTIHOST_LINK_BYTES", 8 << 20))
COUNTS = [0, 1, 7, 1001, 65537, 300_007]  # 0, 1, odd, not divisible by 4 ranks nor by 8/32, several ring chunks
LOSSY_TOL = {"fp16": 2e-3, "bf16": 1.6e-2}  # relative to sum_k |x_k|


def compressions():
    return tuple(getattr(collectives, "COMPRESSIONS", ("none",)))


def allreduce(x, algorithm, compression, name, op="sum"):
    kw = {} if compression == "none" else {"compression": compression}
    return pycomm.allreduce(x, op=op, algorithm=algorithm, name=name, **kw)


def choose_op(algorithm, compression):
    """'sum', or 'avg' for a compression that only averages (refused before any communication)."""
    x = torch.ones(256 * 4, dtype=torch.float32)
    try:
        allreduce(x, algorithm, compression, name=f"mh.op.{algorithm}.{compression}")
        return "sum"
    except (ValueError, TypeError) as refused:
        if compression == "none":
            raise
        try:
            allreduce(x, algorithm, compression, name=f"mh.op.{algorithm}.{compression}", op="avg")
        except (ValueError, TypeError):
            raise refused from None
        return "avg"


def digest(t):
    return hashlib.sha1(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def host_sent():
    out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True, check=True)
    return parse_qdisc_bytes(out.stdout)


def data(rank, count, dtype, seed):
    rng = np.random.default_rng([seed, rank, count])
    return torch.from_numpy(rng.uniform(-100, 100, size=count)).to(dtype)


def check_correct(comm, MPI, algorithm, compression, op):
    """None when correct, else a message."""
    rank = comm.rank
    div = comm.size if op == "avg" else 1
    if compression == "none":
        cases = [(dt, c) for dt in (torch.float64, torch.float32) for c in COUNTS]
    else:
        cases = [(torch.float32, c) for c in COUNTS]
    for dtype, count in cases:
        x = data(rank, count, dtype, seed=11)
        ref = np.empty(count, dtype=x.numpy().dtype)
        comm.Allreduce(x.numpy(), ref, op=MPI.SUM)
        absx = np.abs(x.numpy()).astype(np.float64)
        mag = np.empty(count)
        comm.Allreduce(absx, mag, op=MPI.SUM)
        ref, mag = ref / div, mag / div
        y = allreduce(x.clone(), algorithm, compression, name=f"mh.{algorithm}.{compression}.{dtype}.{count}", op=op)
        what = f"{algorithm}/{compression} {op} {str(dtype).replace('torch.', '')}[{count}]"
        if y.shape != x.shape or y.dtype != x.dtype:
            return f"{what}: result is {y.dtype}{list(y.shape)}"
        err = np.abs(y.numpy().astype(np.float64) - ref.astype(np.float64))
        if compression == "none":
            tol = (1e-12 if dtype == torch.float64 else 1e-5) * (mag + 1)
        elif compression in LOSSY_TOL:
            tol = LOSSY_TOL[compression] * (mag + 1)
        else:
            # 1-bit: the two-phase model from zero residuals (a fresh name), on the inputs of every rank.
            # Same bound as tests/parallel/test_compression.py: 1e-6 relative (float32 summation order of
            # the scales), except elements whose server-side value is within rounding of zero.
            # Across hosts the scheme runs on each host's float32 sum (the hierarchical form): the model
            # follows pycomm's topology (compression_ref.cross_stages).
            _, chunk = layout(count, comm.size)
            xs = [np.asarray(a) for a in comm.allgather(x.numpy())]
            zeros_w, zeros_s = [np.zeros(count, np.float32)] * comm.size, [np.zeros(chunk, np.float32)] * comm.size
            topo = pycomm.topology()
            model, _, _, ambiguous = onebit_model(xs, zeros_w, zeros_s, op == "avg", None, topo.num_nodes,
                                                  topo.local_size, topo.homogeneous)
            err = np.where(ambiguous, 0.0, np.abs(y.numpy().astype(np.float64) - model.astype(np.float64)))
            tol = 1e-6 * np.abs(model.astype(np.float64)) + 1e-30
            ref = model
        bad = np.nonzero(err > tol)[0]
        digests = comm.allgather(digest(y))
        if bad.size:
            i = int(bad[0])
            against = "mpi4py's Allreduce" if compression in ("none", *LOSSY_TOL) else "the two-phase model"
            return (f"{what}: {bad.size} elements differ from {against}, first at [{i}]: "
                    f"{float(y[i])} vs {float(ref[i])}")
        if len(set(digests)) != 1:
            return f"{what}: ranks hold different results"
    return None


def measure_link(comm, local, algorithm, compression, op):
    """Bytes each host sent over its link during one allreduce of LINK_BYTES (list by node)."""
    x = data(comm.rank, LINK_BYTES // 4, torch.float32, seed=5)
    allreduce(x.clone(), algorithm, compression, name=f"mh.warm.{algorithm}.{compression}", op=op)  # connect
    comm.Barrier()
    before = host_sent() if local.rank == 0 else 0
    comm.Barrier()
    allreduce(x, algorithm, compression, name=f"mh.link.{algorithm}.{compression}", op=op)
    comm.Barrier()
    sent = host_sent() - before if local.rank == 0 else None
    return [s for s in comm.allgather(sent) if s is not None]


def main():
    topo = pycomm.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = pycomm.local_comm()
    result = {
        "ranks": comm.allgather({"rank": topo.rank, "host": socket.gethostname(), "node_rank": topo.node_rank,
                                 "num_nodes": topo.num_nodes, "local_rank": topo.local_rank,
                                 "local_size": topo.local_size, "virtual_nodes": topo.virtual_nodes,
                                 "ranks_per_node_env": os.environ.get("PYCOMM_RANKS_PER_NODE")}),
        "link_bytes": LINK_BYTES,
        "checks": {},
    }
    for algorithm in collectives.ALLREDUCE_ALGORITHMS:
        for compression in compressions():
            key = f"{algorithm}/{compression}"
            entry = {}
            try:
                op = choose_op(algorithm, compression)
            except pycomm.CommError as e:  # e.g. a single-node algorithm in a job across hosts
                result["checks"][key] = {"refused": str(e)}
                continue
            except (ValueError, TypeError) as e:  # a combination pycomm does not offer, refused up front
                result["checks"][key] = {"unsupported": str(e)}
                continue
            try:
                entry["op"] = op
                entry["error"] = check_correct(comm, MPI, algorithm, compression, op)
                entry["sent_by_host"] = measure_link(comm, local, algorithm, compression, op)
            except (ValueError, TypeError) as e:  # refused before any communication, alike on every rank
                entry = {"unsupported": str(e)}
            result["checks"][key] = entry
    if comm.rank == 0:
        print("MULTIHOST-RESULT " + json.dumps(result), flush=True)
    pycomm.shutdown()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
