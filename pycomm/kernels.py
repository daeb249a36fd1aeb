"""Compute kernels on torch tensors (CPU or CUDA, chosen by the tensors' device).

The math is docs/algorithms.md §2; the C++ kernels live in csrc/kernels/ and the
collective engine calls the same functions. Every call releases the GIL; CUDA
calls run on torch's current stream and do not synchronize.

- cast:    ``cast_to_half``, ``cast_to_float``, ``accumulate_``
- 1-bit:   ``onebit_compress``, ``onebit_decompress``, ``onebit_decompress_accumulate_``,
           ``onebit_packed_bytes``, ``onebit_num_chunks``
- fusion:  ``fusion_pack``, ``fusion_unpack``
- reduce:  ``reduce_``, ``scale_``
- CPU variants: ``cpu_isa``, ``set_cpu_isa``, ``set_cpu_threads``, ``cpu_threads``
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import _C

__all__ = [
    "accumulate_", "cast_to_float", "cast_to_half", "cpu_isa", "cpu_threads", "fusion_pack", "fusion_unpack",
    "onebit_compress", "onebit_decompress", "onebit_decompress_accumulate_", "onebit_num_chunks",
    "onebit_packed_bytes", "reduce_", "scale_", "set_cpu_isa", "set_cpu_threads", "sparse_count_above",
    "sparse_scatter", "sparse_select",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def _tensor(x, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"pycomm.kernels.{what}: expected a torch.Tensor, got {type(x).__name__}")


# ---------------------------------------------------------------- cast

def cast_to_half(x: torch.Tensor, dtype: torch.dtype = torch.float16, scale: float = 1.0,
                 out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """y = half(x * scale), rounded to nearest even; returns ``(y, nonfinite)``.

    x: float32. dtype: torch.float16 or torch.bfloat16. ``x * scale`` is formed
    in float32 and rounded once to the half type. For averaging pass
    ``scale = 1/N`` (dividing before the cast keeps a sum of N values from
    overflowing fp16). ``nonfinite`` is a one-element int32 tensor on x's
    device: 1 if any output is inf or NaN (overflow, or inf/NaN input), else 0.
    Reading it (``bool(nonfinite)``) synchronizes a CUDA stream.
    """
    _tensor(x, "cast_to_half")
    if dtype not in HALF_DTYPES:
        raise TypeError(f"pycomm.kernels.cast_to_half: dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    flag = torch.empty(1, dtype=torch.int32, device=x.device)
    _C.cast_to_half(x, out, float(scale), flag)
    return out, flag


def cast_to_float(x: torch.Tensor, scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = float(x) * scale for x in float16/bfloat16 (exact widening, then one float32 multiply)."""
    _tensor(x, "cast_to_float")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _C.cast_to_float(x, out, float(scale))
    return out


def accumulate_(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """acc += float(x) in place: float32 accumulator, float16/bfloat16 x (one hop of an fp16 ring)."""
    _tensor(acc, "accumulate_")
    _tensor(x, "accumulate_")
    _C.accumulate_(acc, x)
    return acc


# ---------------------------------------------------------------- 1-bit

def onebit_packed_bytes(n: int) -> int:
    """Bytes of packed sign bits for n elements: ceil(n / 8)."""
    return (int(n) + 7) // 8


def onebit_num_chunks(n: int, chunk: int) -> int:
    """Scales (one per chunk) for n elements: ceil(n / chunk)."""
    return (int(n) + chunk - 1) // chunk


def _chunk_for(n: int, chunk: Optional[int]) -> int:
    if chunk is None:  # one scale for the whole tensor
        return max(8, (int(n) + 7) // 8 * 8)
    chunk = int(chunk)
    if chunk <= 0 or chunk % 8:
        raise ValueError(f"pycomm.kernels: chunk must be a positive multiple of 8, got {chunk}")
    return chunk


def onebit_compress(x: torch.Tensor, residual: torch.Tensor, chunk: Optional[int] = None,
                    mask: Optional[torch.Tensor] = None, bits: Optional[torch.Tensor] = None,
                    scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """1-bit quantization with error feedback; returns ``(bits, scales)``, updates ``residual`` in place.

    x, residual: float32, same number of elements n (flattened). Per chunk j of
    ``chunk`` elements (a multiple of 8; the last chunk may be short; None =
    one chunk for the whole tensor)::

        c = x + e                      (float32)
        s_j = ||c_j||_2 / sqrt(n_j)    (float64 sum of squares, rounded to float32; 0 if n_j = 0)
        bit_i = (c_i >= 0)             (0 and -0 give 1)
        q_i = s_j * (2 bit_i - 1)
        e <- c - q                     (float32)

    bits: uint8[ceil(n/8)], bit i in byte i//8 at position i%8 (little-endian),
    unused bits of the last byte 0. scales: float32[ceil(n/chunk)].
    mask (uint8 or bool, n elements, optional): where it is 0 the element is
    left out of the norm and of n_j, its residual is set to exactly 0 and its
    bit (written 0) means nothing: pass the same mask to decompress to get 0
    there (DeepSpeed's exp_avg_mask).
    """
    _tensor(x, "onebit_compress")
    _tensor(residual, "onebit_compress")
    n = x.numel()
    chunk = _chunk_for(n, chunk)
    if bits is None:
        bits = torch.empty(onebit_packed_bytes(n), dtype=torch.uint8, device=x.device)
    if scales is None:
        scales = torch.empty(onebit_num_chunks(n, chunk), dtype=torch.float32, device=x.device)
    _C.onebit_compress(x, residual, chunk, bits, scales, mask)
    return bits, scales


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, n: int, chunk: Optional[int] = None,
                      mask: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q_i = s_j * (2 bit_i - 1) for i < n (0 where mask is 0); returns float32[n] (or fills ``out``)."""
    _tensor(bits, "onebit_decompress")
    chunk = _chunk_for(n, chunk)
    if out is None:
        out = torch.empty(int(n), dtype=torch.float32, device=bits.device)
    elif out.numel() != n:
        raise ValueError(f"pycomm.kernels.onebit_decompress: out has {out.numel()} elements, expected {n}")
    _C.onebit_decompress(bits, scales, chunk, out, False, 1.0, mask)
    return out


def onebit_decompress_accumulate_(out: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor,
                                  chunk: Optional[int] = None, weight: float = 1.0,
                                  mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out += fl(weight * s_j) * (2 bit_i - 1) in place (unchanged where mask is 0).

    The server side of the compressed allreduce: summing the N workers' chunks
    with ``weight = 1/N`` averages them. ``weight = 1`` adds q exactly.
    """
    _tensor(out, "onebit_decompress_accumulate_")
    chunk = _chunk_for(out.numel(), chunk)
    _C.onebit_decompress(bits, scales, chunk, out, True, float(weight), mask)
    return out


# ---------------------------------------------------------------- fusion

# ---------------------------------------------------------------- sparse (top-k / threshold)

def sparse_count_above(x: torch.Tensor, residual: torch.Tensor, threshold: float) -> int:
    """#{i : |x_i + residual_i| >= threshold} (float32 sum; NaN counts). Waits for the device on CUDA."""
    _tensor(x, "sparse_count_above")
    _tensor(residual, "sparse_count_above")
    return int(_C.sparse_count_above(x, residual, float(threshold)))


def sparse_select(x: torch.Tensor, residual: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k of acc = x + residual by |acc| with error feedback; returns ``(indices int32, values float32)``.

    Order: |acc| descending (NaN above inf), then index ascending; the k chosen
    indices are returned ascending with their acc values, and ``residual``
    becomes acc with those k elements set to 0 (in place).
    """
    _tensor(x, "sparse_select")
    _tensor(residual, "sparse_select")
    k = int(k)
    indices = torch.empty(max(k, 0), dtype=torch.int32, device=x.device)
    values = torch.empty(max(k, 0), dtype=torch.float32, device=x.device)
    _C.sparse_select(x, residual, k, indices, values)
    return indices, values


def sparse_scatter(indices: torch.Tensor, values: torch.Tensor, n: int, scale: float = 1.0,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out[0..n) = scale * sum over rows r (in order) of the pairs (indices[r, j], values[r, j]).

    indices int32 and values float32 of shape (rows, k) (or (k,) for one row).
    """
    _tensor(indices, "sparse_scatter")
    _tensor(values, "sparse_scatter")
    if indices.shape != values.shape:
        raise ValueError(f"pycomm.kernels.sparse_scatter: indices {tuple(indices.shape)} and values "
                         f"{tuple(values.shape)} differ in shape")
    rows, k = (1, indices.numel()) if indices.dim() <= 1 else (indices.shape[0], indices[0].numel())
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=values.device)
    _C.sparse_scatter(indices.reshape(-1), values.reshape(-1), rows, k, out, float(scale))
    return out


def fusion_pack(tensors: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """flat = concat(t.flatten() for t in tensors), one call (one kernel launch on CUDA).

    All tensors share one dtype and device; tensor k lands at elements
    [off_k, off_k + numel_k), off_k the sum of the earlier numels.
    """
    tensors = list(tensors)
    if out is None:
        if not tensors:
            raise ValueError("pycomm.kernels.fusion_pack: no tensors and no out buffer")
        total = sum(t.numel() for t in tensors)
        out = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    _C.fusion_pack(tensors, out)
    return out


def fusion_unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> Sequence[torch.Tensor]:
    """tensors[k] = flat[off_k : off_k + numel_k] * scale, in place; returns ``tensors``.

    scale = 1 is a plain copy (any dtype); otherwise floating types only, and
    fp16/bf16 are scaled in float32 and rounded once (e.g. scale = 1/N after a sum).
    """
    _C.fusion_unpack(flat, list(tensors), float(scale))
    return tensors


# ---------------------------------------------------------------- reduce

def reduce_(dst: torch.Tensor, src: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """dst = dst op src element-wise, in place; op: sum | min | max.

    fp16/bf16 are combined in float32 and rounded once; min/max propagate NaN
    (like numpy.minimum/maximum).
    """
    _C.reduce_(dst, src, op)
    return dst


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """tensor *= factor in place (floating types; fp16/bf16 in float32, rounded once)."""
    _C.scale_(tensor, float(factor))
    return tensor


# ---------------------------------------------------------------- CPU variants

def cpu_isa() -> str:
    """The variant the hand-written CPU kernels use: 'avx512', 'avx2' or 'scalar'."""
    return _C.cpu_isa()


def set_cpu_isa(isa: str) -> str:
    """Choose 'avx512', 'avx2' or 'scalar' (lowered to what the CPU has); returns the one in use.

    The environment variable PYCOMM_CPU_ISA sets the starting choice.
    """
    return _C.set_cpu_isa(isa)


def set_cpu_threads(n: int) -> None:
    """OpenMP threads for CPU kernels on buffers of 1 MiB and more (0 = OpenMP's default)."""
    _C.set_cpu_threads(int(n))


def cpu_threads() -> int:
    """OpenMP threads the CPU kernels use on large buffers."""
    return _C.cpu_threads()
