"""Bandwidth of pycomm's compute kernels against a plain copy of the same bytes.

For every kernel and size: GB/s = (bytes read + bytes written) / median time,
and `vs copy` = the kernel's GB/s over torch's ``copy_`` moving the same
number of bytes (a copy of traffic/2 bytes), measured in the same run on the
same device with the same thread count. Size is the float32 input's bytes
(n = size/4 elements); the kernels' traffic per element:

  cast_to_half      f32 -> f16/bf16 with scale      4 + 2        = 6 B
  cast_to_float     f16 -> f32 with scale           2 + 4        = 6 B
  accumulate_       acc(f32) += f16                 4 + 2 + 4    = 10 B
  reduce_sum_f32    dst += src (f32)                4 + 4 + 4    = 12 B
  reduce_sum_f16    dst += src (f16, fp32 math)     2 + 2 + 2    = 6 B
  onebit_compress   x, e -> e, bits, scales         4 + 4 + 4 + 1/8 = 12.125 B
  onebit_decompress bits, scales -> out             1/8 + 4      = 4.125 B
  onebit_decomp_acc out += q                        1/8 + 4 + 4  = 8.125 B
  fusion_pack       64 tensors -> flat              4 + 4        = 8 B
  fusion_unpack     flat -> 64 tensors, scale 1/N   4 + 4        = 8 B

Examples:
  python bench/kernels.py --quick                      # CPU, 1 MiB .. 64 MiB
  python bench/kernels.py --max-size 256M --threads 1,2 --json out.json
  python bench/kernels.py --device cuda                # on a GPU, 1 MiB .. 1 GiB
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

import torch

# Measure this checkout's build (python setup.py build_ext --inplace) rather
# than whatever pycomm the environment has installed.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if glob.glob(os.path.join(ROOT, "pycomm", "_C*.so")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pycomm  # noqa: E402
from pycomm.tools.benchmark import human_size  # noqa: E402
from pycomm import kernels as K  # noqa: E402

MiB = 1 << 20


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


class Timer:
    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    stat = staticmethod(statistics.median)  # or min, set per run

    def measure(self, fn, repeats: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize()
            for _ in range(repeats):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
        else:
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return self.stat(times)


def split_sizes(n: int, parts: int, gen: torch.Generator) -> list:
    w = torch.rand(parts, generator=gen, dtype=torch.float64) + 0.05
    sizes = (w / w.sum() * n).floor().long().tolist()
    sizes[-1] += n - sum(sizes)
    return sizes


def kernels_for(n: int, device: str, chunk):
    """(name, bytes moved, setup -> fn). Setup allocates and touches the buffers."""
    dev = device
    gen = torch.Generator().manual_seed(0)  # sizes
    dgen = torch.Generator(device=dev).manual_seed(0)  # data, made on the device (fast at 1 GiB on a GPU)

    def randn(m, dtype=torch.float32):
        return torch.randn(m, generator=dgen, device=dev).to(dtype)

    def cast_half(dtype):
        x, y = randn(n), torch.empty(n, dtype=dtype, device=dev)
        return lambda: K.cast_to_half(x, dtype, 0.25, out=y)

    def cast_float():
        h, y = randn(n, torch.float16), torch.empty(n, device=dev)
        return lambda: K.cast_to_float(h, 4.0, out=y)

    def accumulate():
        acc, h = randn(n), randn(n, torch.float16)
        return lambda: K.accumulate_(acc, h)

    def reduce(dtype):
        a, b = randn(n, dtype), randn(n, dtype) * 1e-3
        return lambda: K.reduce_(a, b, "sum")

    def compress():
        x, e = randn(n), randn(n) * 0.1
        bits = torch.empty(K.onebit_packed_bytes(n), dtype=torch.uint8, device=dev)
        c = chunk or max(8, (n + 7) // 8 * 8)
        scales = torch.empty(K.onebit_num_chunks(n, c), device=dev)
        return lambda: K.onebit_compress(x, e, c, bits=bits, scales=scales)

    def decompress(acc):
        x, e = randn(n), torch.zeros(n, device=dev)
        c = chunk or max(8, (n + 7) // 8 * 8)
        bits, scales = K.onebit_compress(x, e, c)
        out = torch.zeros(n, device=dev)
        if acc:
            return lambda: K.onebit_decompress_accumulate_(out, bits, scales, c, weight=0.25)
        return lambda: K.onebit_decompress(bits, scales, n, c, out=out)

    def fusion(unpack):
        ts = [torch.empty(m, device=dev).normal_(generator=dgen) for m in split_sizes(n, 64, gen)]
        flat = K.fusion_pack(ts)
        if unpack:
            return lambda: K.fusion_unpack(flat, ts, 0.25)
        return lambda: K.fusion_pack(ts, out=flat)

    return [
        ("cast_to_half f16", 6 * n, lambda: cast_half(torch.float16)),
        ("cast_to_half bf16", 6 * n, lambda: cast_half(torch.bfloat16)),
        ("cast_to_float f16", 6 * n, cast_float),
        ("accumulate_ f16", 10 * n, accumulate),
        ("reduce_sum_f32", 12 * n, lambda: reduce(torch.float32)),
        ("reduce_sum_f16", 6 * n, lambda: reduce(torch.float16)),
        ("onebit_compress", 12 * n + n // 8, compress),
        ("onebit_decompress", 4 * n + n // 8, lambda: decompress(False)),
        ("onebit_decomp_acc", 8 * n + n // 8, lambda: decompress(True)),
        ("fusion_pack", 8 * n, lambda: fusion(False)),
        ("fusion_unpack", 8 * n, lambda: fusion(True)),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--min-size", default="1M", help="smallest float32 input (bytes; K/M/G suffixes)")
    ap.add_argument("--max-size", default="1G", help="largest float32 input")
    ap.add_argument("--quick", action="store_true", help="sizes 1M, 16M, 64M (capped by --max-size), 3 repeats")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per point (median reported)")
    ap.add_argument("--threads", default="", help="CPU: comma-separated OpenMP thread counts, e.g. 1,2")
    ap.add_argument("--chunk", type=int, default=0, help="1-bit chunk in elements (0 = one chunk per tensor)")
    ap.add_argument("--kernels", default="", help="comma-separated name prefixes to run (default all)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic over the repeats (min shows what an undisturbed run reaches on a shared machine)")
    ap.add_argument("--json", default="", help="write the results to this JSON file")
    args = ap.parse_args(argv)

    device = args.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("bench/kernels.py: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
            return 2
        if not pycomm.cuda_built:
            print("bench/kernels.py: pycomm was built without CUDA", file=sys.stderr)
            return 2
        torch.cuda.set_device(torch.device(device).index or 0)  # "cuda" alone: device 0
    lo, hi = parse_size(args.min_size), parse_size(args.max_size)
    if args.quick:
        sizes = [s for s in (MiB, 16 * MiB, 64 * MiB) if s <= hi] or [lo]
        repeats = min(args.repeats, 3)
    else:
        sizes, s = [], lo
        while s <= hi:
            sizes.append(s)
            s *= 4
        repeats = args.repeats
    threads = [int(t) for t in args.threads.split(",") if t] if not device.startswith("cuda") else [0]
    threads = threads or [0]
    wanted = [p.strip() for p in args.kernels.split(",") if p.strip()]
    timer = Timer(device)
    timer.stat = min if args.stat == "min" else statistics.median
    results = []
    cpu_note = "" if device.startswith("cuda") else f", cpu variant {K.cpu_isa()}"
    print(f"# pycomm kernels on {device}{cpu_note}, torch {torch.__version__}, {args.stat} of {repeats}, "
          f"pycomm from {os.path.dirname(pycomm.__file__)}", flush=True)
    hdr = f"{'kernel':<20}{'size':>8}{'thr':>4}{'time us':>10}{'GB/s':>9}{'copy GB/s':>11}{'vs copy':>9}"
    print(hdr)
    print("-" * len(hdr), flush=True)
    old_torch_threads = torch.get_num_threads()
    for t in threads:
        if not device.startswith("cuda"):
            torch.set_num_threads(t if t else old_torch_threads)
            K.set_cpu_threads(t)
        for size in sizes:
            n = size // 4
            copy_cache = {}
            for name, traffic, setup in kernels_for(n, device, args.chunk or None):
                if wanted and not any(name.startswith(w) for w in wanted):
                    continue
                if traffic not in copy_cache:
                    half = traffic // 2
                    src = torch.ones(half, dtype=torch.uint8, device=device)
                    dst = torch.zeros(half, dtype=torch.uint8, device=device)
                    copy_cache[traffic] = timer.measure(lambda: dst.copy_(src), repeats)
                    del src, dst
                fn = setup()
                sec = timer.measure(fn, repeats)
                del fn
                gbs, copy_gbs = traffic / sec / 1e9, traffic / copy_cache[traffic] / 1e9
                row = dict(kernel=name, device=device, size_bytes=size, elements=n,
                           threads=(t or K.cpu_threads()) if not device.startswith("cuda") else None,
                           bytes_moved=traffic, seconds=sec, gbps=gbs, copy_gbps=copy_gbs, ratio=gbs / copy_gbs)
                results.append(row)
                thr = "-" if row["threads"] is None else str(row["threads"])
                print(f"{name:<20}{human_size(size):>8}{thr:>4}{sec * 1e6:>10.1f}{gbs:>9.2f}{copy_gbs:>11.2f}"
                      f"{gbs / copy_gbs:>8.0%}", flush=True)
    if not device.startswith("cuda"):
        torch.set_num_threads(old_torch_threads)
        K.set_cpu_threads(0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, repeats=repeats, stat=args.stat,
                           cpu_variant=None if device.startswith("cuda") else K.cpu_isa(), results=results), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
