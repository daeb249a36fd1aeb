"""What algorithm="auto" starts from: pycomm-tune's stored table for this job shape, or its machine model.

``pycomm-tune`` (pycomm.tools.tune) measures which allreduce algorithm is fastest at each size and
stores the winners as a table of (largest message in bytes, algorithm) per job shape (ranks, nodes,
ranks per node) in ``$PYCOMM_TUNE_DIR`` (default ``~/.cache/pycomm``), and the machine's cost-model
constants (pycomm.cost_model.Machine) in ``machine.json`` beside the tables, for any job shape.
``pycomm.init()`` reads them here (pycomm.runtime.agreed_tune_table). This module only reads: it
imports _C (the allreduce catalogue) and the cost model, nothing of the tools, so the runtime can use it.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

from . import _C

TUNE_VERSION = 1


def tune_dir() -> str:
    return os.environ.get("PYCOMM_TUNE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pycomm")


def table_path(topo) -> str:
    return os.path.join(tune_dir(), f"tune-{topo.size}ranks-{topo.num_nodes}nodes-{topo.local_size}pernode.json")


def available_algorithms(topo) -> List[str]:
    """The algorithms timed on this topology: those the allreduce catalogue offers."""
    return list(_C.allreduce_offered(topo.size, topo.num_nodes, topo.local_size, topo.homogeneous))


def load_table(topo) -> Optional[List[Tuple[int, str]]]:
    """The stored table for this topology, or None. A stale or foreign file is ignored."""
    path = table_path(topo)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if data.get("version") != TUNE_VERSION or data.get("virtual_nodes") != topo.virtual_nodes:
        return None
    allowed = set(available_algorithms(topo))
    table = [(int(b), str(a)) for b, a in data.get("table", [])]
    if not table or any(a not in allowed for _, a in table):
        return None
    return table


def model_path() -> str:
    """The machine's cost-model constants (pycomm.cost_model), measured by pycomm-tune for any job shape."""
    return os.path.join(tune_dir(), "machine.json")


def load_model():
    """The stored cost_model.Machine, or None (no file, or a stale or foreign one)."""
    from .cost_model import Machine

    try:
        with open(model_path()) as f:
            data = json.load(f)
        if data.get("version") != TUNE_VERSION:
            return None
        return Machine.from_dict(data["constants"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
