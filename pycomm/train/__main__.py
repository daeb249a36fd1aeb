"""``python -m pycomm.train``, deprecated: runs ``python -m pycomm.tools.train`` (pycomm-train)."""
from pycomm._renamed import run_renamed_main
from pycomm.tools.train.__main__ import main

if __name__ == "__main__":
    run_renamed_main("pycomm.train", "pycomm.tools.train", "pycomm-train", main)
