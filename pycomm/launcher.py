"""Deprecated name of pycomm.tools.launcher, kept for one release.

Importing it warns once and gives back pycomm.tools.launcher itself (the same module object);
``python -m pycomm.launcher`` warns and runs pycomm.tools.launcher.
"""
import sys
import warnings

from .tools import launcher as _new

if __name__ == "__main__":
    warnings.warn("python -m pycomm.launcher is deprecated and will be removed in the next release; "
                  "run python -m pycomm.tools.launcher (or pycomm-run) instead", DeprecationWarning)
    sys.exit(_new.main())

# stacklevel 2 names the importing line: warnings skips the import machinery's frames.
warnings.warn("pycomm.launcher is deprecated and will be removed in the next release; "
              "import pycomm.tools.launcher instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _new
