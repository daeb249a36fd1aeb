"""`horovod.torch` is pycomm.horovod itself (the same module object, not a copy)."""
import sys

import pycomm.horovod

sys.modules[__name__] = pycomm.horovod
