"""Deprecated name of pycomm.tools.launcher, kept for one release.

Importing it warns once and gives back pycomm.tools.launcher itself (the same module object);
``python -m pycomm.launcher`` warns and runs pycomm.tools.launcher.
"""
from ._renamed import alias_module, run_renamed_main

if __name__ == "__main__":
    from .tools.launcher import main

    run_renamed_main("pycomm.launcher", "pycomm.tools.launcher", "pycomm-run", main)
else:
    alias_module(__name__, "pycomm.tools.launcher")
