"""torch's own DistributedTest (torch/testing/_internal/distributed/distributed_test.py) on MPI ranks.

    mpirun -np 2 python tests/compat/torch_dist.py --backend pycomm --out DIR [--tests a,b,...]

torch's test_distributed_spawn.py runs every test in fresh processes that it
spawns itself; pycomm's ranks are MPI processes, so here mpirun starts the
ranks once and each rank plays the part of torch's spawned process "rank":
for every test it calls the same TestDistBackend._run(rank, test, file, pipe)
that torch's child process calls (init_process_group over a FileStore, the
test, destroy), and turns its exit code into passed / skipped / failed as
torch's parent process does (every rank 0: passed; a skip code: skipped;
anything else: failed). The tests themselves are torch's, untouched.

A backend that is not built into torch declares its features through torch's
own DistTestCases tables; pycomm declares the ones it has (ddp, subgroup,
cuda, plugin) before the tests are defined, exactly as gloo is listed there.

Each rank appends one JSON line per test to DIR/<rank>.jsonl as it goes. A
test that runs past --test-timeout makes the rank write "timeout" and exit, so
mpirun ends the job; bench/compat.py then starts a new job after that test.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="pycomm")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tests", default="", help="comma-separated test names (default: every test)")
    ap.add_argument("--list", action="store_true", help="print the test names and exit")
    ap.add_argument("--test-timeout", type=float, default=120.0)
    args = ap.parse_args()

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(size)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["TEMP_DIR"] = tempfile.gettempdir()  # read when torch's test module loads; set per test below
    if args.backend == "pycomm":
        import pycomm.distributed  # noqa: F401  registers the backend

    from torch.testing._internal.common_distributed import TEST_SKIPS, DistTestCases

    if args.backend == "pycomm":
        for feature in ("ddp", "subgroup", "cuda", "gpu", "plugin"):
            DistTestCases.backend_feature[feature].add("pycomm")
    import torch.distributed as dist
    from torch.testing._internal.distributed import distributed_test as dt

    class Test(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        pass

    names = sorted(n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test_"))
    if args.list:
        if rank == 0:
            print("\n".join(names))
        return 0
    if args.tests:
        wanted = args.tests.split(",")
        names = [n for n in names if n in wanted]
    skip_codes = {s.exit_code for s in TEST_SKIPS.values()}
    out = open(os.path.join(args.out, f"{rank}.jsonl"), "a", buffering=1)
    import torch.multiprocessing as mp

    for name in names:
        # What TestDistBackend.setUp does once in torch's parent process, done by rank 0 here.
        # TestDistBackend.setUp in torch's parent process: a fresh TEMP_DIR (barrier files, INIT_METHOD)
        # and init file; rank 0 makes them and every rank uses them, as the spawned children inherit them.
        comm.Barrier()
        if rank == 0:
            dt.initialize_temp_directories()
            dt.Barrier.init()
        env = comm.bcast({k: os.environ[k] for k in ("TEMP_DIR", "INIT_METHOD")} if rank == 0 else None, root=0)
        os.environ.update(env)
        file_name = comm.bcast(tempfile.NamedTemporaryFile(delete=False).name if rank == 0 else None, root=0)
        comm.Barrier()
        dt.Barrier.barrier_id = 0
        out.write(json.dumps({"test": name, "event": "start"}) + "\n")
        done = threading.Event()

        def watchdog(name=name):
            if not done.wait(args.test_timeout):
                out.write(json.dumps({"test": name, "event": "failed",
                                      "msg": f"timeout after {args.test_timeout:.0f} s"}) + "\n")
                out.flush()
                os._exit(3)

        threading.Thread(target=watchdog, daemon=True).start()
        parent, child = mp.Pipe()
        start = time.time()
        parent_msg = ""
        try:
            Test._run(rank, name, file_name, child)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException as e:  # noqa: BLE001 (init, the test or destroy raised outside run_test's handling)
            code = 1
            parent_msg = f"{type(e).__name__}: {e}"

        done.set()
        msg = parent_msg
        while parent.poll():
            try:
                msg = str(parent.recv())[-600:]
            except EOFError:
                break
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        codes = comm.allgather(code)
        if all(c == 0 for c in codes):
            event = "passed"
        elif any(c in skip_codes and c != 0 for c in codes) and all(c == 0 or c in skip_codes for c in codes):
            event = "skipped"
        else:
            event = "failed"
        out.write(json.dumps({"test": name, "event": event, "codes": codes, "msg": msg,
                              "seconds": round(time.time() - start, 2)}) + "\n")
        comm.Barrier()
        if rank == 0:
            dt.cleanup_temp_dir()
            try:
                os.remove(file_name)
            except OSError:
                pass
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
