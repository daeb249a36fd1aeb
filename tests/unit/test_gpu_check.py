"""bench/gpu_check.sh fits the GPU machine: its dry run (no GPU needed) shows the step limits adding up
to under 7 minutes, at most six result files, the test files with CUDA cases, and a CUDA_HOME that is
a real toolkit or none (never ".")."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")


def dry_run(tmp_path, **env):
    full = dict(os.environ, GPU_CHECK_DRY_RUN="1", OUT=str(tmp_path), **env)
    p = subprocess.run(["bash", SCRIPT], env=full, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_budget_files_and_device_test_files(tmp_path):
    out = dry_run(tmp_path)
    limits = [int(a) + int(b) for a, b in re.findall(r"limit (\d+) s \+ (\d+) s grace", out)]
    budget = int(re.search(r"budget: (\d+) s", out).group(1))
    assert len(limits) == 8 and sum(limits) == budget and budget < 420, out
    files = re.search(r"files to \S+: (.*)", out).group(1).split()
    assert len(files) <= 6 and files[-1] == "summary.txt", out
    unit = re.search(r"unit files with CUDA cases: (.*)", out).group(1).split()
    parallel = re.search(r"parallel files with CUDA cases: (.*)", out).group(1).split()
    assert "tests/unit/test_kernels_reduce.py" in unit, out
    for name in ("test_staging", "test_hierarchical", "test_same_answer", "test_fusion", "test_ddp_hooks", "test_c10d",
                 "test_c10d_ddp", "test_device_stream", "test_device_compression"):
        assert f"tests/parallel/{name}.py" in parallel, (name, out)
    # Nothing written by a dry run.
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_cuda_home_is_never_a_relative_path(tmp_path):
    out = dry_run(tmp_path, CUDA_HOME=".", CUDA_PATH="")
    home = re.search(r"CUDA_HOME: (.*)", out).group(1)
    assert home == "none found" or (home.startswith("/") and os.path.isfile(os.path.join(home, "bin", "nvcc"))), out
