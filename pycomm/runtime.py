"""Process runtime: MPI bootstrap, topology and the engine's lifetime.

``init()`` initializes MPI through mpi4py with thread level MULTIPLE, makes a
private duplicate of COMM_WORLD for pycomm's traffic, splits it into a
node-local communicator (ranks sharing memory, or virtual nodes of
``PYCOMM_RANKS_PER_NODE`` ranks) and a cross-node communicator (one rank per
node with the same local rank), and starts the C++ engine on them.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

from . import _C

CommError = _C.CommError
RanksFailedError = _C.RanksFailedError  # a CommError: ranks of the job died (elastic mode, docs/elastic.md)


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    homogeneous: bool  # every node has the same number of ranks
    virtual_nodes: bool  # nodes come from PYCOMM_RANKS_PER_NODE, not from shared memory


class _State:
    topology: Optional[Topology] = None
    world = None  # mpi4py communicators, private to pycomm
    local = None
    cross = None
    control = None
    previous_excepthook = None
    elastic = False  # MPI fault tolerance on pycomm's communicators (pycomm.elastic)
    ranks_per_node = None  # as init() was given it, for a restart on a shrunk world
    joined = False  # this process was started by pycomm.elastic.grow and joined a running job


_state = _State()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 0 or 1")


def mpi():
    """The mpi4py.MPI module, initialized with thread level MULTIPLE."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        from .mpi_env import apply_defaults

        apply_defaults()  # fills in OMPI_MCA_osc on one host, never over the user's setting

        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def _install_abort_hook() -> None:
    """After init, an uncaught exception on any rank ends the whole job.

    The other ranks would otherwise wait for this one in its next collective.
    Like ``python -m mpi4py``: print the traceback, then MPI_Abort.
    """
    if _state.previous_excepthook is not None:
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if _state.topology is None or _state.topology.size == 1:  # nobody waits for a single rank
            return
        MPI = mpi()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            if getattr(value, "raised_on_every_rank", False):
                # Every rank raises this error at the same point (pycomm.elastic below its minimum size), so
                # none waits for another: each ends by itself, after its own report. MPI_Abort there, in a
                # job that has lost a rank under ULFM, sometimes never returned (1 run in 4 of
                # test_below_min_np_every_survivor_ends_with_a_clear_error), and its kill could cut the
                # other survivor's report.
                sys.stderr.write(f"pycomm: {kind.__name__} on every rank; rank {_state.topology.rank} ends\n")
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(1)
            sys.stderr.write(f"pycomm: uncaught {kind.__name__} on rank {_state.topology.rank}; aborting the job "
                             "(pycomm.init(abort_on_exception=False) turns this off)\n")
            sys.stderr.flush()
            sys.stdout.flush()
            # The launcher forwards output through its own processes; MPICH's hydra
            # drops what it has not yet forwarded when the abort kills them, and
            # the traceback (and other ranks' messages) came out cut. Give it 0.5 s.
            time.sleep(0.5)
            MPI.COMM_WORLD.Abort(1)

    _state.previous_excepthook = previous
    sys.excepthook = hook


def _remove_abort_hook() -> None:
    if _state.previous_excepthook is not None:
        sys.excepthook = _state.previous_excepthook
        _state.previous_excepthook = None


def init(ranks_per_node: Optional[int] = None, abort_on_exception: bool = True,
         elastic: Optional[bool] = None) -> Topology:
    """Initialize MPI and start the engine. Idempotent; returns the topology.

    ranks_per_node: group ranks into virtual nodes of this many consecutive
    ranks (default: ``PYCOMM_RANKS_PER_NODE``, else the shared-memory split),
    so that multi-node code paths run on one machine.
    abort_on_exception: an uncaught exception on any rank prints its traceback
    and aborts the whole job (MPI_Abort), so the other ranks do not wait for
    it forever. With False, the failing rank leaves through ``shutdown()`` at
    exit and the others get a CommError naming it at their next collective.
    elastic: survive the death of ranks (default: ``PYCOMM_ELASTIC``; docs/elastic.md). Needs MPI's
    fault tolerance (Open MPI launched with ``--with-ft ulfm``: ``pycomm-run --elastic``); refused
    with CommError on every rank otherwise. A death then raises ``RanksFailedError`` on every
    survivor, and ``pycomm.elastic.run`` recovers on the survivors.
    """
    if _state.topology is not None:
        if elastic is not None and bool(elastic) != _state.elastic:
            raise CommError(f"pycomm.init(elastic={bool(elastic)}): pycomm is already initialized with elastic mode "
                            f"{'on' if _state.elastic else 'off'}; call pycomm.shutdown() first")
        if abort_on_exception:
            _install_abort_hook()
        else:
            _remove_abort_hook()
        return _state.topology
    MPI = mpi()
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        raise CommError(
            f"pycomm needs MPI thread level MULTIPLE but MPI provides level {provided}. "
            "Import pycomm (or set mpi4py.rc.thread_level = 'multiple') before mpi4py.MPI is first imported, "
            "and use an MPI built with thread support."
        )
    elastic = _env_bool("PYCOMM_ELASTIC", False) if elastic is None else bool(elastic)
    if elastic:
        why = _C.ulfm_unavailable()
        if why:
            version = MPI.Get_library_version().strip().splitlines()[0]
            raise CommError(f"pycomm.init(elastic=True) on rank {MPI.COMM_WORLD.rank}: {why}. "
                            f"This MPI: {version}. Without elastic mode, leave out elastic=True and PYCOMM_ELASTIC.")
    parent = MPI.Comm.Get_parent() if os.environ.pop(JOIN_ENV, "") == "1" else MPI.COMM_NULL
    if parent != MPI.COMM_NULL:
        if not elastic:
            raise CommError("pycomm.init: this process was started by pycomm.elastic.grow to join a running job; "
                            "it must call pycomm.init(elastic=True) (or leave PYCOMM_ELASTIC=1 set)")
        topo = _join(parent)
    else:
        topo = _start(MPI.COMM_WORLD, ranks_per_node, elastic)
    atexit.register(shutdown)
    if abort_on_exception:
        _install_abort_hook()
    return topo


# Set by pycomm.elastic.grow in the environment of the processes it spawns: they join the running job.
JOIN_ENV = "PYCOMM_ELASTIC_JOIN"


def merged_world(inter, high: bool):
    """The intracommunicator of both sides of `inter` (old ranks first: they merge with high=False),
    with MPI's errors returned (elastic mode). `inter` is freed. Collective over both sides."""
    MPI = mpi()
    merged = inter.Merge(high=high)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    inter.Free()
    return merged


def _join(parent) -> Topology:
    """A process spawned by pycomm.elastic.grow: merge with the running job (after its ranks) and start
    pycomm on the merged world with the job's ranks_per_node and engine options (sent by its rank 0).
    The other side is pycomm.elastic.grow."""
    merged = merged_world(parent, high=True)
    config = merged.bcast(None, root=0)
    topo = _start(merged, config["ranks_per_node"], True)
    _C.set_options({**_C.get_options(), **config["options"]})
    _state.joined = True
    return topo


def node_topology(comm, local, virtual_nodes: bool):
    """The nodes of `comm` (the world, or a process group), given its node-local communicator `local`:
    returns (cross, topology), cross joining the ranks of equal local rank across nodes. A node is named
    by the comm rank of its local rank 0, and nodes are numbered in the order of those ranks. Collective
    over comm."""
    leader = local.bcast(comm.rank, root=0)
    leaders = comm.allgather(leader)
    node_ids = sorted(set(leaders))
    node_rank = node_ids.index(leader)
    local_sizes = comm.allgather(local.size)
    cross = comm.Split(color=local.rank, key=node_rank)
    topo = Topology(rank=comm.rank, size=comm.size, local_rank=local.rank, local_size=local.size,
                    node_rank=node_rank, num_nodes=len(node_ids), homogeneous=len(set(local_sizes)) == 1,
                    virtual_nodes=virtual_nodes)
    return cross, topo


def start_engine(group_id: int, comm, local, cross, control, topo: Topology, options: Optional[dict] = None) -> None:
    """Start engine `group_id` (0: the world, with `options`; a process group takes the world engine's
    options) on its communicators."""
    _C.engine_start(group_id, comm.py2f(), local.py2f(), cross.py2f(), control.py2f(), topo.rank, topo.size,
                    topo.local_rank, topo.local_size, topo.node_rank, topo.num_nodes, topo.homogeneous, options)


def _start(base, ranks_per_node: Optional[int], elastic: bool) -> Topology:
    """Build pycomm's communicators over `base` (COMM_WORLD, or a world shrunk by pycomm.elastic) and
    start the engine on them. Collective over `base`."""
    MPI = mpi()
    world = base.Dup()
    world.Set_name("pycomm.world")
    control = world.Dup()  # coordination messages only
    control.Set_name("pycomm.control")
    if ranks_per_node is None:
        ranks_per_node = _env_int("PYCOMM_RANKS_PER_NODE", 0)
    if ranks_per_node < 0:
        raise ValueError(f"ranks_per_node must be positive, got {ranks_per_node}")
    virtual = ranks_per_node > 0
    if virtual:
        local = world.Split(color=world.rank // ranks_per_node, key=world.rank)
    else:
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)

    cross, topo = node_topology(world, local, virtual)
    if elastic:
        # Failures come back as error codes (the engine turns them into RanksFailedError), never abort.
        for c in (world, control, local, cross):
            c.Set_errhandler(MPI.ERRORS_RETURN)
        _C.fault_enable(world.py2f())
        for c in (control, local, cross):
            _C.fault_watch(c.py2f())
    start_engine(0, world, local, cross, control, topo, options_from_env())
    _state.world, _state.local, _state.cross, _state.control, _state.topology = world, local, cross, control, topo
    _state.elastic, _state.ranks_per_node = elastic, ranks_per_node
    # Measured crossovers for algorithm="auto", if pycomm-tune stored some: rank
    # 0's table, broadcast, so every rank resolves "auto" identically.
    _C.set_options({"auto_table": agreed_tune_table(topo, world)})
    start_timeline_from_env(topo.rank)  # PYCOMM_TIMELINE
    return topo


def start_timeline_from_env(rank: int) -> None:
    """pycomm.init(): start the timeline (pycomm.timeline) named by PYCOMM_TIMELINE, if set."""
    path = os.environ.get("PYCOMM_TIMELINE", "")
    if path and not _C.timeline_path():
        _C.timeline_start(path, rank)
        atexit.register(_C.timeline_stop)


def agreed_tune_table(topo: Topology, comm) -> list:
    """The "auto" table every rank uses: rank 0's stored table (``pycomm-tune``), broadcast on ``comm``.

    Each rank may see another file (its own home directory, another host's
    cache), and "auto" resolved from different tables would run different
    algorithms on different ranks. So only rank 0's counts; a rank whose own
    table differs warns once that it is not used. Without a table for this
    shape, rank 0 builds one from the stored cost-model constants
    (pycomm.cost_model), if any. Empty: the built-in rule. Collective over ``comm``.
    """
    from .auto_choice import available_algorithms, load_model, load_table, table_path

    mine = load_table(topo)
    if comm.rank == 0 and mine is None:
        # No measured table for this shape: the cost model's winners, if the machine's constants are stored.
        machine = load_model()
        if machine is not None and topo.size > 1 and topo.homogeneous:
            from .cost_model import auto_table, shm_pipeline

            chunk, chunked_above = shm_pipeline(topo.local_size)
            mine = auto_table(machine, topo.size, topo.num_nodes, algorithms=available_algorithms(topo),
                              shm_chunk_bytes=chunk, shm_chunked_above=chunked_above)
    table = comm.bcast(mine if comm.rank == 0 else None, root=0) or []
    if comm.rank != 0 and mine is not None and [tuple(e) for e in mine] != [tuple(e) for e in table]:
        import warnings

        warnings.warn(f"pycomm rank {comm.rank}: its tune table {table_path(topo)} differs from rank 0's; "
                      "every rank uses rank 0's so that algorithm='auto' means the same everywhere", UserWarning,
                      stacklevel=2)
    return [(int(b), str(a)) for b, a in table]


def shutdown() -> None:
    """Finish every queued collective, stop the engine and free pycomm's communicators."""
    if _state.topology is None:
        return
    _remove_abort_hook()
    _C.engine_stop()
    _C.timeline_stop()  # after the last operation (the shutdown round)
    failed = _C.fault_failed()
    _C.fault_disable()
    MPI = mpi()
    # After a rank died the communicators are revoked and stay allocated: freeing one is collective in
    # MPI and its dead member would never take part.
    if not MPI.Is_finalized() and not failed:
        for c in (_state.control, _state.cross, _state.local, _state.world):
            c.Free()
    _state.world = _state.local = _state.cross = _state.control = _state.topology = None


def is_initialized() -> bool:
    return _state.topology is not None


def joined() -> bool:
    """Whether this process was started by pycomm.elastic.grow and joined a running job: the ranks that
    were there wait at pycomm.elastic.run's entry, which syncs the state from rank 0."""
    return _state.joined


def topology() -> Topology:
    if _state.topology is None:
        raise CommError("pycomm is not initialized: call pycomm.init() first")
    return _state.topology


def rank() -> int:
    """This process's rank in the job."""
    return topology().rank


def size() -> int:
    """Number of ranks in the job."""
    return topology().size


def local_rank() -> int:
    """Rank within this (possibly virtual) node."""
    return topology().local_rank


def local_size() -> int:
    """Number of ranks on this (possibly virtual) node."""
    return topology().local_size


def node_rank() -> int:
    """Index of this node, 0 .. num_nodes() - 1."""
    return topology().node_rank


def num_nodes() -> int:
    return topology().num_nodes


def world_comm():
    """pycomm's private duplicate of COMM_WORLD (an mpi4py communicator)."""
    topology()
    return _state.world


def local_comm():
    """Communicator of the ranks on this node."""
    topology()
    return _state.local


def cross_comm():
    """Communicator of the ranks with this local rank, one per node, ordered by node."""
    topology()
    return _state.cross


# Engine options: name -> (environment variable, type, default, meaning).
OPTIONS = {
    "ring_chunk_bytes": ("PYCOMM_RING_CHUNK_BYTES", int, 1 << 19,
                         "pipeline chunk of the ring allreduce"),
    "shm_chunk_bytes": ("PYCOMM_SHM_CHUNK_BYTES", int, 768 << 10,
                        "shm allreduces above this run chunk by chunk through a window of two chunks, which "
                        "stays in cache (0: the whole message in one pass through a window of its size)"),
    "auto_ring_min_bytes": ("PYCOMM_AUTO_RING_MIN_BYTES", int, 1 << 16,
                            "below this, algorithm='auto' uses MPI's Allreduce (jobs of several nodes or one rank; "
                            "on one node of several ranks auto uses shm at every size)"),
    "check_consistency": ("PYCOMM_CHECK_CONSISTENCY", bool, True,
                          "compare every call across ranks; disagreements raise CommError everywhere"),
    "fusion_threshold_bytes": ("PYCOMM_FUSION_THRESHOLD", int, 64 << 20,
                               "fuse queued allreduces into buffers up to this size (0: no fusion)"),
    "cycle_time_ms": ("PYCOMM_CYCLE_TIME_MS", float, 2.0,
                      "how long a queued allreduce waits for others to fuse with"),
    "stall_warning_s": ("PYCOMM_STALL_WARNING_S", float, 60.0,
                        "report ranks that have not joined an operation after this long (0: never)"),
    "stall_abort_s": ("PYCOMM_STALL_ABORT_S", float, 600.0,
                      "abort the job when an operation waits this long for a missing rank (0: never)"),
    "staging_chunk_bytes": ("PYCOMM_STAGING_CHUNK_BYTES", int, 4 << 20,
                            "device data without CUDA-aware MPI travels through pinned host chunks of this size"),
    "force_staging": ("PYCOMM_FORCE_STAGING", bool, False,
                      "send host tensors through the staging pipeline too (exercises it without a GPU)"),
    "force_device_direct": ("PYCOMM_FORCE_DEVICE_DIRECT", bool, False,
                            "treat host tensors as device memory under a CUDA-aware MPI (exercises that path)"),
    "peer_path": ("PYCOMM_PEER_PATH", bool, True,
                  "CUDA tensors inside a node without a CUDA-aware MPI: allreduce by peer reads through CUDA IPC "
                  "where every local rank can map the others' memory (probed at the first CUDA allreduce); off: "
                  "staged through host memory"),
    "peer_chunk_bytes": ("PYCOMM_PEER_CHUNK_BYTES", int, 64 << 20,
                         "the peer path reduces at most this much per pass; each rank keeps a device block of "
                         "twice this (for the largest allreduce so far, up to it) that its node's peers map"),
    "force_peer": ("PYCOMM_FORCE_PEER", bool, False,
                   "treat host tensors as device memory on the peer path (exercises it without a GPU; "
                   "peer_path must be on)"),
    "pair_by_name": ("PYCOMM_PAIR_BY_NAME", bool, False,
                     "named operations pair across ranks by name, in any order, as Horovod's do (pycomm.horovod "
                     "turns it on): one that some rank has not submitted yet waits aside without holding up the "
                     "operations behind it; off: every operation pairs by submission order"),
}


def options_from_env() -> dict:
    out = {}
    for name, (env, kind, default, _) in OPTIONS.items():
        if kind is bool:
            out[name] = _env_bool(env, default)
        elif kind is int:
            out[name] = _env_int(env, default)
        else:
            raw = os.environ.get(env)
            try:
                out[name] = default if raw in (None, "") else float(raw)
            except ValueError:
                raise ValueError(f"{env}={raw!r} is not a number") from None
        if kind is not bool and out[name] < 0:
            raise ValueError(f"{env} must not be negative, got {out[name]}")
    return out


def set_options(**options) -> None:
    """Change engine options. Collective: every rank calls it with the same options.

    The change is queued behind the operations already submitted and applied
    at that same point on every rank (asynchronous operations queued before
    it run with the old options); the call returns once it is applied. Ranks
    that pass different options all raise CommError. Names, environment
    variables and meanings: ``pycomm.runtime.OPTIONS``.
    """
    topology()
    for name, value in options.items():
        if name == "auto_table":
            continue
        if name not in OPTIONS:
            raise ValueError(f"unknown option {name!r}; known: {', '.join(OPTIONS)}")
        if OPTIONS[name][1] is not bool and value < 0:
            raise ValueError(f"option {name} must not be negative, got {value}")
    _C.set_options({k: (v if k == "auto_table" else OPTIONS[k][1](v)) for k, v in options.items()})


def get_options() -> dict:
    topology()
    return dict(_C.get_options())


def device_path() -> str:
    """How CUDA tensors travel under this MPI (docs/gpu.md): "direct" (a CUDA-aware MPI reads device
    memory); without one, "peer" (allreduces by peer reads inside the node through CUDA IPC, everything
    else staged), "staged" (through pinned host memory), "staged: <why not peer>" once the peer path
    was refused, or "peer or staged" before the first CUDA allreduce probed it; or "refused: <why>"
    where PYCOMM_CUDA_AWARE=1 claims a CUDA-aware MPI whose library says it was built without CUDA
    (the engine then raises on CUDA tensors rather than hand their pointers to MPI)."""
    if not _C.mpi_cuda_aware():
        running = is_initialized()
        if not (get_options() if running else options_from_env())["peer_path"]:
            return "staged"
        verdict = _C.peer_verdict() if running else ""
        if verdict.startswith("peer"):
            return "peer"
        return verdict or "peer or staged"
    why = _C._direct_path_refusal("CUDA tensors", True, False, _C.mpi_library_cuda_support(),
                                  os.environ.get("PYCOMM_CUDA_AWARE", ""))
    return f"refused: {why}" if why else "direct"


def stats() -> dict:
    """Engine counters: operations completed, coordination rounds, tensors that ran fused, batches a
    waiting caller ran on its own thread instead of the engine's (waiter_batches), and the
    memory the engine keeps between operations: shm_allocations (collective reallocations of the shared
    window; it grows geometrically), shm_segment_bytes, fusion_buffer_bytes, staging_bytes; the device
    movers' cached working memory and fusion buffer (device_cache_bytes / _allocations,
    device_fusion_bytes / _allocations) and the compressed allreduce's working memory
    (compressed_cache_bytes / _allocations, host tensors' included); the peer path's blocks and calls
    (peer_block_bytes, peer_allocations, peer_allreduces); and stream order: ready_waits (operations whose producer
    event the engine waited on), done_events, and the event pools' events_created, events_recorded,
    event_stream_waits, event_host_waits; and device_path, how CUDA tensors travel (device_path())."""
    topology()
    out = dict(_C.stats())
    out["device_path"] = device_path()
    return out
