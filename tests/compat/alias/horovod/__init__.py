"""`import horovod.torch` resolves to pycomm.horovod (tests/compat only; see docs/compatibility.md).

This directory goes first on PYTHONPATH when Horovod's own test suite runs
against pycomm. It renames a module and nothing else: no test is skipped,
patched or wrapped.
"""
