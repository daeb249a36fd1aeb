"""Old names kept for one release.

A module or package that moved answers to its old name with one DeprecationWarning and is the same
module object under both names, so classes and functions compare equal across them. The old module
calls one of these at import; ``python -m old`` runs the new tool through run_renamed_main.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings
from typing import Callable, Optional

# stacklevel 3: this function, the old module's body, then the importing line (warnings skips the
# import machinery's frames).
_IMPORTER = 3


def _message(old: str, new: str) -> str:
    return f"{old} is deprecated and will be removed in the next release; import {new} instead"


def alias_module(old: str, new: str) -> None:
    """`import old` gives back module `new` itself."""
    warnings.warn(_message(old, new), DeprecationWarning, stacklevel=_IMPORTER)
    sys.modules[old] = importlib.import_module(new)


def alias_package(old: str, new: str, namespace: Optional[dict] = None) -> None:
    """Every submodule of package `new` is registered under `old` up front, so that `import old.sub`
    finds the entry the import system checks right after loading `old` and never loads a second copy
    of the file. __main__ is left out: importing it is running it. With `namespace` (the old
    package's globals) the submodules are its attributes and the old package stays its own module;
    without, `old` becomes `new` itself."""
    warnings.warn(_message(old, new), DeprecationWarning, stacklevel=_IMPORTER)
    package = importlib.import_module(new)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name == "__main__":
            continue
        module = importlib.import_module(f"{new}.{info.name}")
        sys.modules[f"{old}.{info.name}"] = module
        if namespace is not None:
            namespace[info.name] = module
    if namespace is None:
        sys.modules[old] = package


def run_renamed_main(old: str, new: str, command: str, main: Callable[[], Optional[int]]) -> None:
    """``python -m old``: warn, then run the tool and exit with its status."""
    # stacklevel 2: the warning is the old __main__'s, which Python's default filters show.
    warnings.warn(f"python -m {old} is deprecated and will be removed in the next release; "
                  f"run python -m {new} (or {command}) instead", DeprecationWarning, stacklevel=2)
    sys.exit(main())
