"""``pycomm-train`` / ``python -m pycomm.tools.train``: see pycomm/tools/train/cli.py for the options."""
from __future__ import annotations

import sys
import traceback
from typing import Optional, Sequence

from .cli import UsageError, launcher_rank, parse_args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from .loop import train

    try:
        train(args)
    except UsageError as e:
        # Raised identically on every rank before training starts: report once, exit everywhere.
        if launcher_rank() == 0:
            sys.stderr.write(f"pycomm-train: error: {e}\n")
            sys.stderr.flush()
        return 2
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        # Anything else may have hit one rank only; the others would wait for it in
        # a collective. Print the traceback and abort the whole job instead of hanging.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        import pycomm

        if pycomm.is_initialized():
            from mpi4py import MPI

            sys.stderr.write(f"pycomm-train: rank {pycomm.rank()} failed; aborting the job\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
