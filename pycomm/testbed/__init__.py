"""Deprecated name of pycomm.tools.testbed, kept for one release.

Importing this package, or any pycomm.testbed.<module>, warns once and gives back pycomm.tools.testbed's
names and module objects: pycomm.testbed.Testbed is pycomm.tools.testbed.Testbed.
``python -m pycomm.testbed`` warns and runs pycomm.tools.testbed (pycomm-testbed).
"""
from .._renamed import alias_package
from ..tools.testbed import *  # noqa: F401,F403
from ..tools.testbed import __all__  # noqa: F401

alias_package(__name__, "pycomm.tools.testbed", globals())
