"""Deprecated name of pycomm.tools.benchmark, kept for one release.

Importing it warns once and gives back pycomm.tools.benchmark itself (the same module object).
"""
import sys
import warnings

from .tools import benchmark as _new

# stacklevel 2 names the importing line: warnings skips the import machinery's frames.
warnings.warn("pycomm.benchmark is deprecated and will be removed in the next release; "
              "import pycomm.tools.benchmark instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _new
