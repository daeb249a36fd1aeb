"""pycomm.cost_model: predicted allreduce time of each algorithm from measured machine constants.

The alpha-beta-gamma model (Thakur, Rabenseifner and Gropp 2005; Patarasuk and
Yuan 2009) extended by the costs pycomm's own paths add. For S bytes on N
ranks, M nodes of L ranks each:

    alpha    s per point-to-point message inside a node (latency)
    beta     s per byte sent point to point inside a node
    gamma    s per byte reduced (read two operands, write one)
    delta    s per byte copied (the copies in and out of the shared window)
    sync     s per fence of the shared window (a barrier of the node: a counter in the window)
    alpha_x, beta_x   alpha and beta across nodes (equal to alpha, beta on one host)
    kappa    s per float32 byte cast to or from fp16/bf16
    omega    s per float32 byte of one 1-bit compression pass (signs, scale, residual)

    ring(S, N)   = 2(N-1) alpha + 2(N-1)/N S beta + (N-1)/N S gamma
    mpi(S, N)    = min(recursive doubling  ceil(log2 N) (alpha + S beta + S gamma),
                       reduce-scatter + allgather  2 ceil(log2 N) alpha + 2(N-1)/N S beta + (N-1)/N S gamma)
    gamma_c  s per byte reduced with both operands in cache (a chunk of the shm pipeline)

    shm(S, L)    = sync + S delta + (L-1) S gamma_c                     up to 32 KiB (one fence:
                   every rank copies in and reduces the whole message from the L segments)
                 = 3 sync + (2L-1)/L S delta + (L-1)/L S gamma          one pass
                   (copy in the (L-1)/L the peers reduce, reduce the own slice in place with
                   the L-1 peers' slices and copy it in, copy the L-1 peers' slices out)
                 = (2 ceil(S/C) + 1) sync + S delta + (L-1)/L S gamma_c  chunk by chunk, above the
                   pipeline threshold (shm_chunk_bytes C > 0): only the tensor goes to memory and
                   back (S delta: one copy's traffic), the slice reduction runs in cache
    hierarchical(S, M, L) = 3 sync + 2 S delta + (L-1)/L S gamma + ring_x(S/L, M)
                   (shm reduce-scatter, one cross-node ring per local rank on its S/L shard, shm allgather)
    hierarchical_master(S, M, L) = 4 sync + 2 S delta + (L-1)/L S gamma + (L-1)/L S delta + ring_x(S, M)
                   (the master also collects the L-1 other slices, then rings the whole S among masters)
    fp16 / bf16(S, N) = 2 S kappa + ring(S/2, N)      (cast in and out; half the bytes on the ring)
    onebit(S, N) = 2(N-1) alpha + 2(N-1)/N (S/32 + 4N) beta + (2 + 2/N) S omega + S/N gamma
                   (all-to-all and allgather of signs + one scale per chunk; the worker compresses
                   all S and decompresses all S, the server recompresses and averages its S/N)

ring_x is ring with alpha_x and beta_x. These are bounds of a simple model (no
contention between ranks that share a core or the memory bus, no overlap of
the ring's chunks); ``bench/allreduce.py --model`` prints them beside the
measurements. ``pycomm-tune`` measures the constants
(pycomm.tools.machine.measure) and stores them beside its table;
``pycomm.init()`` builds the "auto" table from them (``auto_table``, through
pycomm.auto_choice) when a job shape has constants but no measured table.
This module is part of the runtime: it imports only pycomm._C, never the tools.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Dict, List, Optional, Tuple

#: The exact algorithms this model has a formula for: every entry of the allreduce catalogue
#: (csrc/comm/allreduce_catalogue.cpp; tests/unit/test_allreduce_catalogue.py holds them equal).
ALGORITHMS = ("ring", "mpi", "shm", "hierarchical", "hierarchical_master")
#: The compressions this model has a formula for: every entry of the engine's compression table
#: (csrc/comm/compressed_allreduce.cpp, _C.engine_compressions(); the same test holds them equal).
COMPRESSED = ("fp16", "bf16", "onebit")


@dataclass(frozen=True)
class Machine:
    """Measured constants, in seconds and seconds per byte (see the module's docstring)."""
    alpha: float
    beta: float
    gamma: float
    delta: float
    sync: float
    alpha_x: float
    beta_x: float
    kappa: float
    omega: float
    # None: not measured (constants stored by an older pycomm-tune); predictions then take gamma.
    gamma_c: Optional[float] = None

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in _OPTIONAL:
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"cost_model.Machine: {f.name} must be a finite number >= 0, got {v!r}")

    @property
    def gamma_cache(self) -> float:
        return self.gamma if self.gamma_c is None else self.gamma_c

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, float]) -> "Machine":
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d and n not in _OPTIONAL]
        if missing:
            raise ValueError(f"cost_model.Machine: missing {', '.join(missing)}")
        return cls(**{n: (None if d.get(n) is None else float(d[n])) for n in names})


_OPTIONAL = ("gamma_c",)
SHM_ONE_FENCE_BYTES = 32 << 10  # csrc/comm/algorithms.h kShmOneFenceBytes


def _ring(S: float, N: int, alpha: float, beta: float, gamma: float) -> float:
    if N <= 1 or S <= 0:
        return 0.0
    return 2 * (N - 1) * alpha + 2 * (N - 1) / N * S * beta + (N - 1) / N * S * gamma


def _mpi(S: float, N: int, m: Machine) -> float:
    if N <= 1 or S <= 0:
        return 0.0
    lg = math.ceil(math.log2(N))
    doubling = lg * (m.alpha + S * m.beta + S * m.gamma)
    rabenseifner = 2 * lg * m.alpha + 2 * (N - 1) / N * S * m.beta + (N - 1) / N * S * m.gamma
    return min(doubling, rabenseifner)


def _shm_part(S: float, L: int, m: Machine) -> float:
    """Copy in, reduce the own slice, copy out, 3 fences: the node-local share of shm and hierarchical."""
    return 3 * m.sync + 2 * S * m.delta + (L - 1) / L * S * m.gamma


def _shm(S: float, L: int, m: Machine, chunk_bytes: int, chunked_above: Optional[int]) -> float:
    """One-node shm in the form the engine picks for S bytes (see the module's docstring)."""
    if S <= SHM_ONE_FENCE_BYTES:
        return m.sync + S * m.delta + (L - 1) * S * m.gamma_cache
    if chunk_bytes > 0 and chunked_above is not None and S > chunked_above:
        chunks = math.ceil(S / chunk_bytes)
        return (2 * chunks + 1) * m.sync + S * m.delta + (L - 1) / L * S * m.gamma_cache
    # The own slice is reduced where it lies: S/L less copied than hierarchical's node-local share.
    return _shm_part(S, L, m) - S / L * m.delta


def shm_pipeline(local_size: int) -> Tuple[int, Optional[int]]:
    """This process's shm chunk size and the size above which shm runs chunk by chunk (None: never),
    as the engine decides them (pycomm.get_options()["shm_chunk_bytes"], the last-level cache)."""
    from . import _C

    chunk = int(_C.get_options()["shm_chunk_bytes"])  # raises pycomm.CommError before pycomm.init()
    return chunk, (_C.shm_pipeline_min_bytes(local_size, chunk) if chunk > 0 else None)


def predict(algorithm: str, nbytes: int, machine: Machine, ranks: int, nodes: int = 1,
            shm_chunk_bytes: int = 0, shm_chunked_above: Optional[int] = None) -> float:
    """Predicted seconds of one allreduce of `nbytes` with `algorithm` (or fp16/bf16/onebit compression).

    shm_chunk_bytes, shm_chunked_above: the shm pipeline (shm_pipeline()); the defaults model the
    one-pass form at every size above 32 KiB."""
    if ranks < 1 or nodes < 1 or ranks % nodes:
        raise ValueError(f"cost_model.predict: {ranks} ranks on {nodes} nodes is not nodes of equal size")
    if nbytes < 0:
        raise ValueError(f"cost_model.predict: nbytes must be >= 0, got {nbytes}")
    S, N, M, L, m = float(nbytes), ranks, nodes, ranks // nodes, machine
    if N == 1 or S == 0:
        return 0.0
    if algorithm == "ring":
        # One flat ring over all ranks: the slowest hop sets the pace when it spans nodes.
        return _ring(S, N, m.alpha_x if M > 1 else m.alpha, m.beta_x if M > 1 else m.beta, m.gamma)
    if algorithm == "mpi":
        return _mpi(S, N, m if M == 1 else Machine(**{**m.to_dict(), "alpha": m.alpha_x, "beta": m.beta_x}))
    if algorithm == "shm":
        if M > 1:
            raise ValueError("cost_model.predict: 'shm' runs on one node only")
        return _shm(S, L, m, shm_chunk_bytes, shm_chunked_above)
    if algorithm == "hierarchical":
        if L == 1:
            return _ring(S, M, m.alpha_x, m.beta_x, m.gamma)
        return _shm_part(S, L, m) + _ring(S / L, M, m.alpha_x, m.beta_x, m.gamma)
    if algorithm == "hierarchical_master":
        if L == 1:
            return _ring(S, M, m.alpha_x, m.beta_x, m.gamma)
        return _shm_part(S, L, m) + m.sync + (L - 1) / L * S * m.delta + _ring(S, M, m.alpha_x, m.beta_x, m.gamma)
    if algorithm in ("fp16", "bf16"):
        a, b = (m.alpha_x, m.beta_x) if M > 1 else (m.alpha, m.beta)
        return 2 * S * m.kappa + _ring(S / 2, N, a, b, m.gamma)
    if algorithm == "onebit":
        a, b = (m.alpha_x, m.beta_x) if M > 1 else (m.alpha, m.beta)
        wire = S / 32 + 4 * N  # signs of S/4 elements and one float scale per chunk
        return 2 * (N - 1) * a + 2 * (N - 1) / N * wire * b + (2 + 2 / N) * S * m.omega + S / N * m.gamma
    raise ValueError(f"cost_model.predict: unknown algorithm {algorithm!r}; known: "
                     f"{', '.join(ALGORITHMS + COMPRESSED)}")


def available(ranks: int, nodes: int, homogeneous: bool = True) -> List[str]:
    """The exact algorithms worth modelling on a job of this shape, as the allreduce catalogue
    offers them (pycomm-tune times the same list)."""
    from . import _C
    local_size = ranks // nodes if homogeneous else max(1, ranks // max(nodes, 1))
    return list(_C.allreduce_offered(ranks, nodes, local_size, homogeneous))


def best(nbytes: int, machine: Machine, ranks: int, nodes: int = 1,
         algorithms: Optional[List[str]] = None, shm_chunk_bytes: int = 0,
         shm_chunked_above: Optional[int] = None) -> Tuple[str, float]:
    """The algorithm with the smallest predicted time, and that time (ties: the first listed)."""
    algos = algorithms or available(ranks, nodes)
    times = {a: predict(a, nbytes, machine, ranks, nodes, shm_chunk_bytes, shm_chunked_above) for a in algos}
    winner = min(algos, key=lambda a: times[a])
    return winner, times[winner]


def crossover_table(best: List[Tuple[int, str]]) -> List[Tuple[int, str]]:
    """[(size, winner)] sorted by size -> [(largest size, algorithm)], merging neighbours
    with the same winner; the last entry covers every larger message."""
    table: List[Tuple[int, str]] = []
    for size, algo in sorted(best):
        if table and table[-1][1] == algo:
            table[-1] = (size, algo)
        else:
            table.append((size, algo))
    if table:
        table[-1] = (2 ** 62, table[-1][1])
    return table


def auto_table(machine: Machine, ranks: int, nodes: int = 1, min_bytes: int = 1 << 10,
               max_bytes: int = 1 << 30, algorithms: Optional[List[str]] = None, shm_chunk_bytes: int = 0,
               shm_chunked_above: Optional[int] = None) -> List[Tuple[int, str]]:
    """An "auto" table (largest message, algorithm) from the model's winners at powers of 2."""
    picks, size = [], min_bytes
    while size <= max_bytes:
        picks.append((size, best(size, machine, ranks, nodes, algorithms, shm_chunk_bytes, shm_chunked_above)[0]))
        size *= 2
    return crossover_table(picks)


def __getattr__(name):
    # measure() needs a running job and moved to the tools with pycomm-tune; the runtime never imports them.
    if name == "measure":
        raise AttributeError("pycomm.cost_model.measure moved to pycomm.tools.machine.measure "
                             "(the runtime never imports the tools)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
