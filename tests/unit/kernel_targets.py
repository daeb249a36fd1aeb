"""Where the kernel tests run: every CPU variant (AVX-512, AVX2, scalar) and CUDA when present."""
import pytest
import torch

import pycomm
from pycomm import kernels as K

ISAS = ["avx512", "avx2", "scalar"]  # the hand-written fp16/bf16 variants
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False" if not torch.cuda.is_available() else (
    "pycomm was built without CUDA" if not pycomm.cuda_built else None)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA is not None, reason=str(NO_CUDA)))]
TARGETS = [pytest.param(("cpu", isa), id=f"cpu-{isa}") for isa in ISAS] + [
    pytest.param(("cuda", None), id="cuda", marks=pytest.mark.skipif(NO_CUDA is not None, reason=str(NO_CUDA)))]


def select_target(request):
    """Generator body of a fixture over TARGETS: pick the CPU variant, yield the device, restore."""
    dev, isa = request.param
    if dev == "cpu":
        if K.set_cpu_isa(isa) != isa:
            K.set_cpu_isa("avx512")
            pytest.skip(f"this CPU has no {isa}")
    yield dev
    K.set_cpu_isa("avx512")
