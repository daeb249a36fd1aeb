"""Deprecated name of pycomm.tools.train, kept for one release.

Importing this package, or any pycomm.train.<module>, warns once and gives back pycomm.tools.train's own
module objects: pycomm.train.cli.parse_args is pycomm.tools.train.cli.parse_args.
``python -m pycomm.train`` warns and runs pycomm.tools.train (pycomm-train).
"""
import importlib
import pkgutil
import sys
import warnings

from ..tools import train as _new

# stacklevel 2 names the importing line: warnings skips the import machinery's frames.
warnings.warn("pycomm.train is deprecated and will be removed in the next release; "
              "import pycomm.tools.train instead", DeprecationWarning, stacklevel=2)

# Registered under the old names up front, so that `import pycomm.train.cli` finds the entry the import
# system checks right after loading this package, and never loads a second copy of the file.
# __main__ is left out: importing it is running it (this package's own __main__ does that).
for _info in pkgutil.iter_modules(_new.__path__):
    if _info.name != "__main__":
        _module = importlib.import_module(f"{_new.__name__}.{_info.name}")
        sys.modules[f"{__name__}.{_info.name}"] = _module
        globals()[_info.name] = _module
