"""Deprecated name of pycomm.tools.build_info, kept for one release.

Importing it warns once and gives back pycomm.tools.build_info itself (the same module object).
"""
import sys
import warnings

from .tools import build_info as _new

# stacklevel 2 names the importing line: warnings skips the import machinery's frames.
warnings.warn("pycomm.build_info is deprecated and will be removed in the next release; "
              "import pycomm.tools.build_info instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _new
