"""Instructions one asynchronous allreduce submission costs its caller, counted by callgrind.

A shared machine moves bench/submit_cost.py's microseconds by more than a small change to the
submission path does; an instruction count does not move. This script runs itself on one rank under
`valgrind --tool=callgrind`, collecting only inside pybind11's dispatcher (the C++ side of every
binding call): `--steps` steps of `--tensors` calls of `pycomm._C.allreduce_async` on float32 tensors
of 1-4 KiB, each step waited for. It then prints, per call, the inclusive instruction count of the
binding with pybind11's casts, of its body, and of the engine's parts.

Then the whole call as Python code makes it, once per face: the same steps, the calls made by
`itertools.starmap` and collected only inside it, on the calling thread (`--separate-threads`, so
the engine thread's work is not counted): the interpreter's call, `pycomm.allreduce_async`'s C entry
(csrc/bindings/allreduce_entry.cpp) or pybind11's dispatch, and the submission both reach. The
difference between the two faces is what the entry saves (negative) or costs against the binding.

    python bench/submit_instructions.py            # about 4 minutes; needs valgrind on PATH
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
     r"pycomm::bindings::(?:\(anonymous namespace\)::)?allreduce_async\("),
    ("Engine::allreduce", r"pycomm::comm::Engine::allreduce\(pycomm::comm::AllreduceArgs"),
    ("Engine::allreduce_op", r"pycomm::comm::Engine::allreduce_op\("),
    ("Engine::enqueue", r"pycomm::comm::Engine::enqueue\("),
    ("bindings::keep", r"pycomm::bindings::keep\("),
    ("bindings::to_buffer", r"pycomm::bindings::to_buffer\("),
)


# The faces timed whole (--face): the same allreduce (float32 average, in place, named) through each.
FACES = ("pycomm.allreduce_async", "_C.allreduce_async")


def workload(steps: int, tensors: int, face: str) -> None:
    import itertools
    import random

    import torch

    import pycomm
    from pycomm import _C

    pycomm.init()
    rng = random.Random(0)
    calls = [(torch.randn(rng.randint(256, 1024)), f"grad.{i}") for i in range(tensors)]
    if face == "pycomm.allreduce_async":
        def submit(g, m):
            return pycomm.allreduce_async(g, op="avg", name=m)
    else:
        def submit(g, m):
            return _C.allreduce_async(g, g, "sum", True, "auto", m, False, 0)
    for _ in range(steps):
        handles = list(itertools.starmap(submit, calls))  # starmap_next: where the whole-call count collects
        for h in handles:
            h.wait()


def callgrind(args, out: str, toggle: str, face: str, *extra: str) -> None:
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", f"--toggle-collect={toggle}",
                    *extra, sys.executable, __file__, "--workload", f"--face={face}", f"--steps={args.steps}",
                    f"--tensors={args.tensors}"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tensors", type=int, default=400)
    p.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)  # the run under valgrind
    p.add_argument("--face", choices=FACES, default="_C.allreduce_async", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.workload:
        workload(args.steps, args.tensors, args.face)
        return
    for tool in ("valgrind", "callgrind_annotate"):
        if shutil.which(tool) is None:
            sys.exit(f"submit_instructions: {tool} is not on PATH (Debian: apt-get install valgrind)")
    calls = args.steps * args.tensors
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        callgrind(args, out, "pybind11::cpp_function::dispatcher*", "_C.allreduce_async")
        listing = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out],
                                 check=True, capture_output=True, text=True).stdout
        whole = {}
        for face in FACES:
            out_face = os.path.join(tmp, face)
            callgrind(args, out_face, "starmap_next", face, "--separate-threads=yes")
            # With --separate-threads, file -01 is the main thread, the one that makes the calls.
            totals = subprocess.run(["callgrind_annotate", out_face + "-01"], check=True, capture_output=True,
                                    text=True).stdout
            m = re.search(r"^\s*([\d,]+) .*PROGRAM TOTALS", totals, re.M)
            whole[face] = int(m.group(1).replace(",", "")) if m else None
    print(f"# {calls} calls of _C.allreduce_async ({args.steps} steps of {args.tensors}, 1 rank), "
          f"instructions a call (callgrind, inclusive)")
    for row, pattern in PARTS:
        counts = [int(m.group(1).replace(",", "")) for line in listing.splitlines()
                  if re.search(pattern, line) and (m := re.match(r"\s*([\d,]+)\s", line))]
        print(f"{row:<55} {max(counts) / calls:>8.0f}" if counts else f"{row:<55} {'(not found)':>8}")
    print("# the whole call from Python, calling thread only, instructions a call")
    for face in FACES:
        row = f"{face}(t, op='avg', name=...)" if face.startswith("pycomm") else f"{face}(...) (no checks)"
        print(f"{row:<55} {whole[face] / calls:>8.0f}" if whole[face] else f"{row:<55} {'(not found)':>8}")
    if all(whole.values()):
        print(f"{'the entry against the binding (the difference)':<55} {(whole[FACES[0]] - whole[FACES[1]]) / calls:>8.0f}")


if __name__ == "__main__":
    main()
