"""Compressors beyond the engine's own (none, fp16, bf16, onebit): one file per method.

They are registered in pycomm.compression's registry (``compression="powersgd"``,
``"topk"``, ``"threshold"``, or ``"name:parameter"``, e.g. ``"powersgd:4"``),
so DistributedOptimizer, the DDP hooks and pycomm-train take them by name.
See docs/seeds-methods.md.
"""
