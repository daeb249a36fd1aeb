"""Deprecated name of pycomm.tools.testbed, kept for one release.

Importing this package, or any pycomm.testbed.<module>, warns once and gives back pycomm.tools.testbed's
names and module objects: pycomm.testbed.Testbed is pycomm.tools.testbed.Testbed.
``python -m pycomm.testbed`` warns and runs pycomm.tools.testbed (pycomm-testbed).
"""
import importlib
import pkgutil
import sys
import warnings

from ..tools import testbed as _new
from ..tools.testbed import *  # noqa: F401,F403
from ..tools.testbed import __all__  # noqa: F401

# stacklevel 2 names the importing line: warnings skips the import machinery's frames.
warnings.warn("pycomm.testbed is deprecated and will be removed in the next release; "
              "import pycomm.tools.testbed instead", DeprecationWarning, stacklevel=2)

# Registered under the old names up front, so that `import pycomm.testbed.plan` finds the entry the
# import system checks right after loading this package, and never loads a second copy of the file.
# __main__ is left out: importing it is running it (this package's own __main__ does that).
for _info in pkgutil.iter_modules(_new.__path__):
    if _info.name != "__main__":
        _module = importlib.import_module(f"{_new.__name__}.{_info.name}")
        sys.modules[f"{__name__}.{_info.name}"] = _module
        globals()[_info.name] = _module
