"""Deprecated name of pycomm.tools.benchmark, kept for one release.

Importing it warns once and gives back pycomm.tools.benchmark itself (the same module object).
"""
from ._renamed import alias_module

alias_module(__name__, "pycomm.tools.benchmark")
