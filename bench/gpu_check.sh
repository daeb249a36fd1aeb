#!/usr/bin/env bash
# One-shot check of the CUDA kernels on a lent GPU machine (H200, sm_90).
#
# Its python3 has torch (CUDA), nvcc, ninja, pybind11 and mpi4py, and there is
# no network. Steps, each under a time limit so the whole run stays under 6
# minutes:
#   1. build pycomm in place with CUDA for sm_90 only;
#   2. run the kernel tests: the CUDA parameters compare the device kernels
#      with the numpy references and with the CPU kernels;
#   3. run bench/kernels.py on the GPU, 1 MiB .. 1 GiB;
#   4. print the benchmark table last.
# Results also go to $OUT (if set) or build/gpu_check/.
#
#   bash bench/gpu_check.sh            # from the repository root
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
RES="${OUT:-build/gpu_check}"
mkdir -p "$RES"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
[ -x "$CUDA_HOME/bin/nvcc" ] || CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"
export PYCOMM_CUDA=1 TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -z "${MPICC:-}" ] && ! command -v mpicc >/dev/null && [ ! -x "$(dirname "$(command -v "$PY")")/mpicc" ]; then
  MPICC="$("$PY" -c 'import mpi4py; print(mpi4py.get_config().get("mpicc", ""))' 2>/dev/null || true)"
  [ -n "$MPICC" ] && export MPICC
fi
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }

stamp "environment"
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "device",
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' 2>&1 | tee "$RES/env.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader 2>/dev/null | tee -a "$RES/env.txt"

stamp "build (sm_90, MAX_JOBS=$MAX_JOBS)"
if ! timeout 240 "$PY" setup.py build_ext --inplace >"$RES/build.log" 2>&1; then
  tail -n 40 "$RES/build.log"
  stamp "BUILD FAILED (log: $RES/build.log)"
  exit 1
fi
"$PY" -c 'import pycomm; assert pycomm._C.cuda_built, "built without CUDA"; print("cuda_built", pycomm._C.cuda_built)' \
  || { stamp "IMPORT FAILED"; exit 1; }

stamp "kernel tests on CUDA vs CPU"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_kernels_cast.py tests/unit/test_kernels_onebit.py \
  tests/unit/test_kernels_fusion.py tests/unit/test_kernels_reduce.py -k "cuda" -rs 2>&1 | tee "$RES/tests.txt" | tail -n 25
tests_rc=${PIPESTATUS[0]}

stamp "benchmark on the GPU"
timeout 120 "$PY" bench/kernels.py --device cuda --max-size 1G --repeats 10 --json "$RES/kernels_cuda.json" \
  >"$RES/bench.txt" 2>&1
bench_rc=$?

stamp "done: tests rc=$tests_rc, bench rc=$bench_rc"
echo
cat "$RES/bench.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
