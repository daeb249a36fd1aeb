"""Deprecated name of pycomm.tools.build_info, kept for one release.

Importing it warns once and gives back pycomm.tools.build_info itself (the same module object).
"""
from ._renamed import alias_module

alias_module(__name__, "pycomm.tools.build_info")
