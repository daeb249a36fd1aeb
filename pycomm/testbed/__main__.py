"""``python -m pycomm.testbed``, deprecated: runs ``python -m pycomm.tools.testbed`` (pycomm-testbed)."""
from pycomm._renamed import run_renamed_main
from pycomm.tools.testbed import main

if __name__ == "__main__":
    run_renamed_main("pycomm.testbed", "pycomm.tools.testbed", "pycomm-testbed", main)
