"""Defaults pycomm fills into the environment before MPI initializes (never overriding the user).

Open MPI's UCX one-sided component (osc/ucx) prints "OSC UCX component
priority set inside component query failed" at every MPI_Init on a machine
without a UCX network device, i.e. on every plain ``mpirun`` of a pycomm
script on such a machine. pycomm's only one-sided MPI use is shared-memory
windows on node-local communicators (MPI_Win_allocate_shared, served by
osc/sm on any machine), so osc/ucx is never what pycomm needs on one host.

The rule: ``OMPI_MCA_osc=^ucx`` is filled in only when
  1. the user has not set ``OMPI_MCA_osc`` (an explicit choice always wins:
     ``OMPI_MCA_osc=ucx`` keeps UCX), and
  2. the job is known to run on one host: a singleton (no launcher
     variables) or an Open MPI launch whose ``OMPI_COMM_WORLD_LOCAL_SIZE``
     equals ``OMPI_COMM_WORLD_SIZE``.
Across hosts it is left alone: the user's own one-sided MPI traffic between
hosts may want UCX, and ``pycomm-run`` already passes ``--mca osc ^ucx`` on
one host only. Under MPICH (no ``OMPI_*`` launch variables but a PMI
launch) nothing is set: the variable means nothing there.
"""
from __future__ import annotations

import os
from typing import MutableMapping, Optional


def osc_default(env: MutableMapping[str, str]) -> Optional[str]:
    """The value pycomm fills into OMPI_MCA_osc for `env`, or None to leave it alone."""
    if "OMPI_MCA_osc" in env:
        return None
    world, local = env.get("OMPI_COMM_WORLD_SIZE"), env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if world is not None:
        return "^ucx" if local is not None and local == world else None
    if any(k in env for k in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "HYDRA_CONTROL_FD")):
        return None  # another launcher (MPICH/hydra, Slurm PMI): host count unknown here
    return "^ucx"  # a singleton: one process, one host


def apply_defaults(env: MutableMapping[str, str] = os.environ) -> None:
    """Fill in pycomm's MPI defaults (see the module docstring); call before mpi4py.MPI is imported."""
    value = osc_default(env)
    if value is not None:
        env["OMPI_MCA_osc"] = value
