"""CUDA cases of the tests/parallel files: real CUDA tensors where a GPU is visible, skipped otherwise.

Ranks of one node share its GPUs round-robin (two ranks on one device is how bench/gpu_check.sh runs
them). The host stand-ins (force_staging / force_device_direct) are what CPU machines run of the same
control flow.
"""
import pytest
import torch

import pycomm

NO_CUDA_REASON = (f"needs a CUDA device: pycomm built {'with' if pycomm.cuda_built else 'without'} CUDA, "
                  f"torch {torch.__version__} sees {torch.cuda.device_count() if torch.cuda.is_available() else 0} "
                  "device(s)")
needs_cuda = pytest.mark.skipif(not (pycomm.cuda_built and torch.cuda.is_available()), reason=NO_CUDA_REASON)


def rank_device() -> torch.device:
    """This rank's GPU: its local rank modulo the node's GPU count."""
    return torch.device("cuda", pycomm.local_rank() % torch.cuda.device_count())
