# pycomm: set up, build, run and test from nothing.
#
#   make run    the main job: 4-rank synchronous SGD on the bundled digits data, ending with an allreduce bandwidth table
#   make test   every test: one-process unit tests and the MPI tests at 1, 2, 3 and 4 ranks
#   make compat Horovod's and torch's own test suites on pycomm, one table (docs/compatibility.md)
#
# The virtual environment lives in .venv (override with VENV=...). torch is the
# CPU build unless an NVIDIA driver is present (override with TORCH_SPEC=...).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch==2.14.1,torch==2.13.0)
NP ?= 4

.PHONY: all venv build run train bench test test-unit test-mpi compat clean

all: build

venv: $(VENV)/.deps

$(VENV)/.deps: requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# Editable install of the Python package (console scripts pycomm-run, pycomm-train, ...),
# and the native module built in place; ninja recompiles only what changed.
build: $(VENV)/.installed
	$(PY) setup.py -q build_ext --inplace

$(VENV)/.installed: $(VENV)/.deps setup.py pyproject.toml
	PYCOMM_NO_EXTENSION=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

run: train

train: build
	$(VENV)/bin/pycomm-run -np $(NP) -- $(VENV)/bin/pycomm-train --algorithm ssgd --dataset digits --model mlp --epochs 8

bench: build
	$(VENV)/bin/pycomm-run -np $(NP) -- $(PY) bench/allreduce.py --min-bytes 1M --max-bytes 64M

test: build
	$(PY) -m pytest --durations=20 tests

test-unit: build
	$(PY) -m pytest tests/unit

test-mpi: build
	$(PY) -m pytest tests/test_parallel.py

# Horovod's and torch's own test suites on pycomm: one table (docs/compatibility.md).
compat: build
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) bench/compat.py --ranks 2,3,4 --suites horovod,torch-gloo,torch --failures

clean:
	rm -rf build *.egg-info pycomm/_C*.so $(VENV)/.installed
