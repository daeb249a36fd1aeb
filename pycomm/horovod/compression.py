"""Horovod's gradient compression classes (horovod.torch.compression) for pycomm.horovod.

``Compression.none`` and ``Compression.fp16`` behave as Horovod's: ``compress``
returns (tensor, ctx), ``decompress`` restores the dtype; fp16 casts floating
tensors to float16 for the wire and leaves other dtypes alone.
``Compression.onebit`` is pycomm's own 1-bit compression with error feedback
(pycomm.compression.OneBit): hvd.allreduce runs it per tensor name, and
hvd.DistributedOptimizer gives the optimizer its own residuals.
"""
from __future__ import annotations


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx) -> tensor``."""

    pycomm_name = "none"  # the pycomm.compression scheme DistributedOptimizer uses for it

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    pycomm_name = "none"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16; the result is cast back to the input dtype."""

    pycomm_name = "fp16"

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            import torch

            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx is not None and tensor.dtype != ctx else tensor


class OneBitCompressor(Compressor):
    """pycomm's 1-bit compression with error feedback (float32 tensors, Average or Sum, needs a name)."""

    pycomm_name = "onebit"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class Compression:
    """Namespace of the compressions: none, fp16, onebit."""

    none = NoneCompressor
    fp16 = FP16Compressor
    onebit = OneBitCompressor


def _is_onebit(compression) -> bool:
    return getattr(compression, "pycomm_name", None) == "onebit"


def pycomm_compression(compression, what: str) -> str:
    """The pycomm.compression name for a Horovod compression class."""
    name = getattr(compression, "pycomm_name", None)
    if name is None:
        raise TypeError(f"pycomm.horovod.{what}: compression must be hvd.Compression.none, .fp16 or .onebit, "
                        f"got {compression!r}")
    return name
