"""``python -m pycomm.train``, deprecated: runs ``python -m pycomm.tools.train`` (pycomm-train)."""
import sys
import warnings

from pycomm.tools.train.__main__ import main

if __name__ == "__main__":
    warnings.warn("python -m pycomm.train is deprecated and will be removed in the next release; "
                  "run python -m pycomm.tools.train (or pycomm-train) instead", DeprecationWarning)
    sys.exit(main())
