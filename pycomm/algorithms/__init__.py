"""Deprecated name of pycomm.training, kept for one release.

"Algorithm" also names the allreduce algorithms (ring, shm, ...), so the training algorithms moved to
pycomm.training. Importing this package, or any pycomm.algorithms.<module>, warns once and gives back
pycomm.training's own module objects: pycomm.algorithms.ssgd.SSGD is pycomm.training.ssgd.SSGD.
"""
import importlib
import pkgutil
import sys
import warnings

from .. import training

# stacklevel 2 names the importing line: warnings skips the import machinery's frames.
warnings.warn("pycomm.algorithms is deprecated and will be removed in the next release; "
              "import pycomm.training instead", DeprecationWarning, stacklevel=2)

# Registered under the old names up front, so that `import pycomm.algorithms.ssgd` finds the entry the
# import system checks right after loading the parent, and never loads a second copy of the file (whose
# classes would differ from pycomm.training's). The registry imports every submodule already.
for _info in pkgutil.iter_modules(training.__path__):
    sys.modules[f"{__name__}.{_info.name}"] = importlib.import_module(f"{training.__name__}.{_info.name}")
sys.modules[__name__] = training
