"""Deprecated name of pycomm.tools.train, kept for one release.

Importing this package, or any pycomm.train.<module>, warns once and gives back pycomm.tools.train's own
module objects: pycomm.train.cli.parse_args is pycomm.tools.train.cli.parse_args.
``python -m pycomm.train`` warns and runs pycomm.tools.train (pycomm-train).
"""
from .._renamed import alias_package

alias_package(__name__, "pycomm.tools.train", globals())
