"""Deprecated name of pycomm.tools.tune, kept for one release.

Importing it warns once and gives back pycomm.tools.tune itself (the same module object);
``python -m pycomm.tune`` warns and runs pycomm.tools.tune.
"""
from ._renamed import alias_module, run_renamed_main

if __name__ == "__main__":
    from .tools.tune import main

    run_renamed_main("pycomm.tune", "pycomm.tools.tune", "pycomm-tune", main)
else:
    alias_module(__name__, "pycomm.tools.tune")
