"""Whether a C++ compiler links libstdc++ as a shared library, as torch does.

A compiler that links it statically (a toolchain under /opt/gcc was first on PATH on a GPU machine) puts
a second copy of libstdc++ inside pycomm._C beside the one torch loads; that copy crashed in its
uninitialised locale at the first ostream use in pycomm.init(). setup.py refuses such a compiler and
bench/gpu_check.sh picks another. The probe is a shared object that uses an ostream, read with readelf.
Standard library only: setup.py loads this file by path before pycomm is built.

    python pycomm/tools/cxx_check.py CXX    # exit 0: shared; 1: static; 2: cannot tell
"""
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

PROBE = "#include <sstream>\nstd::string probe(long x) { std::ostringstream s; s << x; return s.str(); }\n"


def links_libstdcxx_shared(cxx: str) -> Optional[bool]:
    """True if `cxx` links libstdc++ as a shared library, False if statically, None if the probe cannot
    tell (no such compiler, no readelf, or the probe does not build)."""
    cxx_path, readelf = shutil.which(cxx), shutil.which("readelf")
    if not cxx_path or not readelf:
        return None
    with tempfile.TemporaryDirectory() as d:
        src, lib = os.path.join(d, "probe.cpp"), os.path.join(d, "probe.so")
        with open(src, "w") as f:
            f.write(PROBE)
        if subprocess.run([cxx_path, "-shared", "-fPIC", src, "-o", lib], capture_output=True).returncode != 0:
            return None
        needed = subprocess.run([readelf, "-d", lib], capture_output=True, text=True).stdout
    return "libstdc++" in needed


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python pycomm/tools/cxx_check.py CXX")
    shared = links_libstdcxx_shared(sys.argv[1])
    sys.exit(2 if shared is None else 0 if shared else 1)
