"""The CI slice of bench/matrix.py, run under mpirun by tests/test_train_slice.py.

Inside one job (start-up paid once) every rank runs pycomm-train's train() for
every algorithm once (with the default optimizer, sgd) and every other optimizer
once (with the default algorithm, ssgd), at pycomm-train's defaults except
--epochs; rank 0 prints one JSON line per run: {"run": ..., "seed": ..., "accuracy": ...,
"final_loss": ..., "warned": ...} ("warned": pycomm-train's chance-level warning came).

    pycomm-run -np 4 -- python tests/train_slice.py --epochs 2 --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def runs():
    from pycomm.training import names
    from pycomm.tools.train.optimizers import OPTIMIZERS

    return ([("algorithm", a, ["--algorithm", a]) for a in names()]
            + [("optimizer", o, ["--optimizer", o]) for o in OPTIMIZERS if o != "sgd"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--dataset", default="digits")
    opts = p.parse_args()
    import pycomm
    from pycomm.tools.train.cli import parse_args
    from pycomm.tools.train.loop import train

    pycomm.init()
    for seed in opts.seeds:
        for kind, name, argv in runs():
            argv = [*argv, "--dataset", opts.dataset, "--epochs", str(opts.epochs), "--seed", str(seed),
                    "--no-progress", "--no-bandwidth-table"]
            with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("always")
                summary = train(parse_args(argv))
            if pycomm.rank() == 0:
                print(json.dumps({"run": f"{kind} {name}", "seed": seed, "accuracy": summary["final_test_accuracy"],
                                  "final_loss": summary["final_train_loss"],
                                  "warned": any("at chance level" in str(w.message) for w in caught)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
