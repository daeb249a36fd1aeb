"""``python -m pycomm.testbed``, deprecated: runs ``python -m pycomm.tools.testbed`` (pycomm-testbed)."""
import sys
import warnings

from pycomm.tools.testbed import main

if __name__ == "__main__":
    warnings.warn("python -m pycomm.testbed is deprecated and will be removed in the next release; "
                  "run python -m pycomm.tools.testbed (or pycomm-testbed) instead", DeprecationWarning)
    sys.exit(main())
