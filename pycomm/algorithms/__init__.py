"""Deprecated name of pycomm.training, kept for one release.

"Algorithm" also names the allreduce algorithms (ring, shm, ...), so the training algorithms moved to
pycomm.training. Importing this package, or any pycomm.algorithms.<module>, warns once and gives back
pycomm.training's own module objects: pycomm.algorithms.ssgd.SSGD is pycomm.training.ssgd.SSGD.
"""
from .._renamed import alias_package

alias_package(__name__, "pycomm.training")
