"""Compressors beyond the engine's own (none, fp16, bf16, onebit): one file per method.

They are registered in pycomm.compression's registry (``compression="powersgd"``,
``"topk"``, ``"threshold"``, or ``"name:parameter"``, e.g. ``"powersgd:4"``),
so DistributedOptimizer, the DDP hooks and pycomm-train take them by name.
See docs/seeds-methods.md.
"""
from ..compression import register
from .powersgd import PowerSGD
from .threshold import Threshold
from .topk import TopK

# The one place these names enter the registry; pycomm/__init__.py imports this package right after
# pycomm.compression, so every layer sees them (the imports go compressors -> compression only).
register("powersgd", PowerSGD, PowerSGD.from_spec)
register("topk", TopK, TopK.from_spec)
register("threshold", Threshold, Threshold.from_spec)

__all__ = ["PowerSGD", "Threshold", "TopK"]
