"""Instructions one asynchronous allreduce submission costs its caller, counted by callgrind.

A shared machine moves bench/submit_cost.py's microseconds by more than a small change to the
submission path does; an instruction count does not move. This script runs itself on one rank under
`valgrind --tool=callgrind`, collecting only inside pybind11's dispatcher (the C++ side of every
binding call): `--steps` steps of `--tensors` calls of `pycomm._C.allreduce_async` on float32 tensors
of 1-4 KiB, each step waited for. It then prints, per call, the inclusive instruction count of the
binding with pybind11's casts, of its body, and of the engine's parts.

    python bench/submit_instructions.py            # about 2 minutes; needs valgrind on PATH
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

# (row, a regular expression for the function's line in callgrind_annotate's inclusive listing)
PARTS = (
    ("binding, with pybind11's argument and Handle casts",
     r"pybind11::cpp_function::initialize<std::shared_ptr<pycomm::bindings::Handle> \(\*&\)\(at::Tensor const&, "
     r"at::Tensor const&, std::__cxx11::basic_string"),
    ("its body (allreduce_async, csrc/bindings/comm.cpp)",
     r"pycomm::bindings::\(anonymous namespace\)::allreduce_async\("),
    ("Engine::allreduce", r"pycomm::comm::Engine::allreduce\(pycomm::comm::AllreduceArgs"),
    ("Engine::allreduce_op", r"pycomm::comm::Engine::allreduce_op\("),
    ("Engine::enqueue", r"pycomm::comm::Engine::enqueue\("),
    ("bindings::keep", r"pycomm::bindings::keep\("),
    ("bindings::to_buffer", r"pycomm::bindings::to_buffer\("),
)


def workload(steps: int, tensors: int) -> None:
    import random

    import torch

    import pycomm
    from pycomm import _C

    pycomm.init()
    rng = random.Random(0)
    grads = [torch.randn(rng.randint(256, 1024)) for _ in range(tensors)]
    names = [f"grad.{i}" for i in range(tensors)]
    for _ in range(steps):
        handles = [_C.allreduce_async(g, g, "sum", True, "auto", m, False, 0) for g, m in zip(grads, names)]
        for h in handles:
            h.wait()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tensors", type=int, default=400)
    p.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)  # the run under valgrind
    args = p.parse_args(argv)
    if args.workload:
        workload(args.steps, args.tensors)
        return
    for tool in ("valgrind", "callgrind_annotate"):
        if shutil.which(tool) is None:
            sys.exit(f"submit_instructions: {tool} is not on PATH (Debian: apt-get install valgrind)")
    calls = args.steps * args.tensors
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                        "--toggle-collect=pybind11::cpp_function::dispatcher*", sys.executable, __file__,
                        "--workload", f"--steps={args.steps}", f"--tensors={args.tensors}"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        listing = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out],
                                 check=True, capture_output=True, text=True).stdout
    print(f"# {calls} calls of _C.allreduce_async ({args.steps} steps of {args.tensors}, 1 rank), "
          f"instructions a call (callgrind, inclusive)")
    for row, pattern in PARTS:
        counts = [int(m.group(1).replace(",", "")) for line in listing.splitlines()
                  if re.search(pattern, line) and (m := re.match(r"\s*([\d,]+)\s", line))]
        print(f"{row:<55} {max(counts) / calls:>8.0f}" if counts else f"{row:<55} {'(not found)':>8}")


if __name__ == "__main__":
    main()
