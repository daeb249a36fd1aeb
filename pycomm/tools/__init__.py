"""pycomm's tools: programs and helpers built on the runtime, never imported by it.

    launcher     pycomm-run (mpirun with pycomm's defaults; --check-build)
    build_info   the report of pycomm-run --check-build
    cxx_check    whether a C++ compiler links libstdc++ shared, as torch does (setup.py, bench/gpu_check.sh)
    tune         pycomm-tune (measures the "auto" table and, through machine, the cost model's constants)
    machine      measuring the cost model's constants on a running job (pycomm.cost_model.Machine)
    benchmark    timing helpers for bench/ and the tools
    train/       pycomm-train (data, models, the training loop, metrics, checkpoints)
    testbed/     pycomm-testbed (emulated hosts joined by a rate-limited network)

The tools import the runtime (pycomm and its modules); no module of the runtime imports pycomm.tools
(tests/unit/test_layers.py checks it). Importing this package imports none of its modules.
"""
