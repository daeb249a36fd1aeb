"""Deprecated name of pycomm.tools.tune, kept for one release.

Importing it warns once and gives back pycomm.tools.tune itself (the same module object);
``python -m pycomm.tune`` warns and runs pycomm.tools.tune.
"""
import sys
import warnings

from .tools import tune as _new

if __name__ == "__main__":
    warnings.warn("python -m pycomm.tune is deprecated and will be removed in the next release; "
                  "run python -m pycomm.tools.tune (or pycomm-tune) instead", DeprecationWarning)
    sys.exit(_new.main())

# stacklevel 2 names the importing line: warnings skips the import machinery's frames.
warnings.warn("pycomm.tune is deprecated and will be removed in the next release; "
              "import pycomm.tools.tune instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _new
