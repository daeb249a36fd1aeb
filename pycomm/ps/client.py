"""The parameter server: placement, push/pull client, clocks, statistics, state, shutdown.

    ps = pycomm.ps.ParameterServer(UpdateRule(lr=0.1, momentum=0.9))   # collective over the job
    if ps.is_worker:
        ps.register(model.named_parameters())        # worker 0's values go to the servers, all pull them
        ps.push("fc.weight", grad); ps.pull("fc.weight", param)
        h = ps.push_async(name, g); h.wait()
        ps.push_pull("fc.weight", grad, param)         # both in one request; the local shard in one pass
    else:
        ps.serve()                                    # dedicated server rank: until every worker is done
    ps.shutdown()

Placement: ``servers=0`` (co-located) makes every rank a worker and a server,
its server loop on a thread of its own; ``servers=K`` makes the last K ranks
dedicated servers (BytePS layout; ``pycomm-run --servers K`` sets
``PYCOMM_PS_SERVERS``). Every tensor is split into K equal element ranges,
server j holding range j, so load is balanced in bytes whatever the tensor
sizes. Traffic runs on a duplicate of pycomm's world communicator.
"""
from __future__ import annotations

import atexit
import os
import socket
import warnings
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import _C
from ..runtime import CommError, mpi, topology, world_comm
from .rules import UpdateRule

_STATUS = {1: "no worker has initialized it yet", 2: "the servers' shard has another size", 3: "bad server state",
           4: "the server could not reach this worker's memory (its stderr names the error)"}
HIST_BINS = 64


def servers_from_env() -> int:
    raw = os.environ.get("PYCOMM_PS_SERVERS", "")
    if raw == "":
        return 0
    try:
        k = int(raw)
    except ValueError:
        raise ValueError(f"PYCOMM_PS_SERVERS={raw!r} is not an integer") from None
    if k < 0:
        raise ValueError(f"PYCOMM_PS_SERVERS must be >= 0, got {k}")
    return k


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc: the servers do not watch processes
        return None


@dataclass
class _Entry:
    key: int
    shape: Tuple[int, ...]
    numel: int
    initialized: bool = False


class Handle:
    """An outstanding push or pull; ``wait()`` raises CommError if a server refused it."""

    def __init__(self, req, what: str, on_ok=None):
        self._req, self._what, self._on_ok, self._status = req, what, on_ok, None

    def wait(self) -> None:
        if self._status is None:
            self._status = self._req.wait()
            if self._status == 0 and self._on_ok is not None:
                self._on_ok()
        if self._status != 0:
            raise CommError(f"{self._what}: {_STATUS.get(self._status, f'status {self._status}')}")

    def done(self) -> bool:
        return self._status is not None or self._req.test()


class ParameterServer:
    """Sharded parameter server over MPI point-to-point (see the module docstring). Collective to create."""

    def __init__(self, rule: Optional[UpdateRule] = None, servers: Optional[int] = None,
                 staleness_bound: Optional[int] = None, stall_report_s: float = 60.0,
                 worker_ranks: Optional[Sequence[int]] = None, shared_memory: Optional[bool] = None):
        topo = topology()
        self.rule = UpdateRule() if rule is None else rule
        if not isinstance(self.rule, UpdateRule):
            raise TypeError(f"rule must be a pycomm.ps.UpdateRule, got {type(self.rule).__name__}")
        k = servers_from_env() if servers is None else int(servers)
        if k < 0 or k >= topo.size and k != 0:
            raise ValueError(f"pycomm.ps: servers={k} dedicated server ranks leave no worker in a job of "
                             f"{topo.size} rank(s); use 0 (co-located) or 1..{topo.size - 1}")
        if staleness_bound is not None and staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0 (or None: no clocks), got {staleness_bound}")
        self.dedicated = k > 0
        n = topo.size
        self.server_ranks: List[int] = list(range(n - k, n)) if k else list(range(n))
        self.worker_ranks: List[int] = list(range(n - k)) if k else list(range(n))
        if worker_ranks is not None:  # co-located servers on every rank, only these ranks push and pull
            if k:
                raise ValueError("pycomm.ps: worker_ranks applies to co-located servers (servers=0)")
            wr = sorted(set(int(r) for r in worker_ranks))
            if not wr or wr[0] < 0 or wr[-1] >= n:
                raise ValueError(f"pycomm.ps: worker_ranks {list(worker_ranks)} must be ranks 0..{n - 1}")
            self.worker_ranks = wr
        self.num_servers, self.num_workers = len(self.server_ranks), len(self.worker_ranks)
        self.rank = topo.rank
        self.is_worker = self.rank in self.worker_ranks
        self.is_server = self.rank in self.server_ranks
        self.worker_index = self.worker_ranks.index(self.rank) if self.is_worker else -1
        self.staleness_bound = staleness_bound
        self.comm = world_comm().Dup()
        self.comm.Set_name("pycomm.ps")
        # Workers among themselves (barriers, agreement of registered names); servers get their own.
        self.worker_comm = self.comm.Split(0 if self.is_worker else 1, self.rank)
        cfg = self.rule.native()
        cfg["staleness_bound"] = -1 if staleness_bound is None else int(staleness_bound)
        cfg["stall_report_s"] = float(stall_report_s)
        # Who is where: a server watches the processes of the workers on its host (same host name and pid
        # namespace, so the pid means the same process) and names one that dies.
        ident = self.comm.allgather((socket.gethostname(), _pid_namespace(), os.getpid()))
        here = ident[self.rank][:2]
        cfg["worker_pids"] = [ident[r][2] if ident[r][:2] == here and here[1] is not None else 0
                              for r in self.worker_ranks]
        self._server = _C.PsServer(self.comm.py2f(), self.worker_ranks, cfg) if self.is_server else None
        self._client = _C.PsClient(self.comm.py2f(), self.server_ranks) if self.is_worker else None
        self.shared_servers, self.shared_memory_error = self._probe_shared_memory(ident, shared_memory)
        if self._client is not None:
            self._client.set_shared([self.server_ranks.index(r) for r in self.shared_servers])
        self._entries: Dict[str, _Entry] = {}
        self.clock_value = 0
        self.bytes_pushed = self.bytes_pulled = 0
        self._closed = False
        self._said_done = False
        self._threaded = self.is_server and (self.is_worker or worker_ranks is not None)
        if self._threaded:
            self._server.start()
        atexit.register(self.shutdown)

    def _probe_shared_memory(self, ident, wanted: Optional[bool]) -> Tuple[List[int], Optional[str]]:
        """Which servers reach this worker's memory directly (collective). A server on the worker's host (same
        host name and pid namespace) reads a token from every such worker with process_vm_readv; where that
        works, push, pull and push_pull to it carry only a header (protocol.h kPushShared). wanted: None uses
        it where it works (PYCOMM_PS_SHARED_MEMORY=0 turns it off), False never, True requires it. Where it
        is used and the kernel refuses (ptrace restrictions, seccomp), the worker warns once and its data to
        those servers goes through MPI messages; with True on any rank, every rank raises instead."""
        required = wanted is True
        if wanted is None:
            wanted = os.environ.get("PYCOMM_PS_SHARED_MEMORY", "1").lower() not in ("0", "false", "no", "off")
        token = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
        where = self.comm.allgather((int(token.ctypes.data), token.tobytes(), bool(wanted), required))
        use = all(w[2] for w in where)
        if any(w[3] for w in where) and not use:
            raise CommError(f"pycomm.ps on rank {self.rank}: shared_memory=True on some ranks and off on others "
                            f"(ranks off: {[r for r, w in enumerate(where) if not w[2]]})")
        reached, errors = [], {}
        if use and self.is_server:
            for r in self.worker_ranks:
                if r == self.rank or ident[r][:2] != ident[self.rank][:2] or ident[r][1] is None:
                    continue
                err, data, text = _C.ps_memory_probe(ident[r][2], where[r][0], 16)
                if err == 0 and data == where[r][1]:
                    reached.append(r)
                else:
                    errors[r] = text or "read back other bytes"
        results = self.comm.allgather((reached, errors))  # also: every server is done reading the tokens
        del token
        shared = [r for r in self.server_ranks if self.rank in results[r][0]]
        if any(err for _, err in results) and any(w[3] for w in where):
            pairs = [f"server rank {srv} -> worker rank {wr}: {text}"
                     for srv, (_, err) in enumerate(results) for wr, text in sorted(err.items())]
            raise CommError("pycomm.ps: shared_memory=True, but servers cannot reach the memory of workers on "
                            "their host (process_vm_readv): " + "; ".join(pairs))
        missed = {srv: err[self.rank] for srv, (_, err) in enumerate(results) if self.rank in err}
        if not missed:
            return shared, None
        error = "; ".join(f"server rank {srv}: {text}" for srv, text in sorted(missed.items()))
        warnings.warn(f"pycomm.ps on rank {self.rank}: servers on this host cannot reach this worker's memory "
                      f"(process_vm_readv: {error}); its pushes and pulls to them go through MPI messages",
                      RuntimeWarning, stacklevel=3)
        return shared, error

    # -- names -----------------------------------------------------------------
    def _worker_only(self, what: str) -> None:
        if self._closed:
            raise CommError(f"pycomm.ps.{what} on rank {self.rank}: the parameter server was shut down")
        if not self.is_worker:
            raise CommError(f"pycomm.ps.{what} on rank {self.rank}: this rank is a dedicated server; "
                            "only worker ranks push and pull (call serve() here)")

    def declare(self, name: str, shape: Sequence[int]) -> None:
        """Make `name` known on this worker (same order on every worker). Its value comes from init()."""
        self._worker_only("declare")
        if not isinstance(name, str):
            raise TypeError(f"pycomm.ps.declare: name must be a str, got {type(name).__name__}")
        shape = tuple(int(s) for s in shape)
        if name in self._entries:
            if self._entries[name].shape != shape:
                raise ValueError(f"pycomm.ps.declare('{name}') on rank {self.rank}: already declared with shape "
                                 f"{self._entries[name].shape}, now {shape}")
            return
        self._entries[name] = _Entry(len(self._entries), shape, int(np.prod(shape, dtype=np.int64)))

    def names(self) -> List[str]:
        return list(self._entries)

    def register(self, named_tensors: Union[Dict[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]],
                 root: int = 0) -> None:
        """Collective over workers: declare every tensor, send worker `root`'s values to the servers, and
        overwrite every worker's tensors with them. Names, shapes and order must agree on every worker."""
        self._worker_only("register")
        items = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        sig = [(n, tuple(t.shape), str(t.dtype)) for n, t in items]
        sigs = self.worker_comm.allgather(sig)
        for w, s in enumerate(sigs):
            if s != sig:
                diff = next((a, b) for a, b in zip(sig + [None] * len(s), s + [None] * len(sig)) if a != b)
                raise ValueError(f"pycomm.ps.register: workers disagree on the tensors: worker {self.worker_index} "
                                 f"has {diff[0]}, worker {w} has {diff[1]}")
        for n, t in items:
            self._check(n, t, "register", declare=True)
        if self.worker_index == root:
            hs = [self.init_async(n, t) for n, t in items]
            for h in hs:
                h.wait()
            self.flush()
        self.worker_comm.Barrier()
        for n, t in items:
            self._entries[n].initialized = True
        hs = [self.pull_async(n, t) for n, t in items]
        for h in hs:
            h.wait()
        self.barrier()  # every worker's first pull is served before anyone pushes

    def _check(self, name: str, t: torch.Tensor, what: str, declare: bool = False) -> _Entry:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pycomm.ps.{what}('{name}') on rank {self.rank}: expected a torch.Tensor, "
                            f"got {type(t).__name__}")
        if declare:
            self.declare(name, t.shape)
        e = self._entries.get(name)
        if e is None:
            known = ", ".join(self._entries) if len(self._entries) <= 8 else f"{len(self._entries)} names"
            raise ValueError(f"pycomm.ps.{what}('{name}') on rank {self.rank}: unknown name; declared: "
                             f"{known or '(none)'}; register or declare it first")
        if t.dtype != torch.float32:
            raise TypeError(f"pycomm.ps.{what}('{name}') on rank {self.rank}: dtype {t.dtype}; the parameter "
                            "server holds float32 (use .float())")
        if tuple(t.shape) != e.shape:
            raise ValueError(f"pycomm.ps.{what}('{name}') on rank {self.rank}: shape {tuple(t.shape)} differs "
                             f"from the registered {e.shape}")
        if t.device.type != "cpu":
            raise ValueError(f"pycomm.ps.{what}('{name}') on rank {self.rank}: tensor on {t.device}; the "
                             "parameter server takes CPU tensors (use .cpu())")
        if not t.is_contiguous():
            raise ValueError(f"pycomm.ps.{what}('{name}') on rank {self.rank}: tensor is not contiguous; "
                             "call .contiguous()")
        return e

    # -- push / pull -------------------------------------------------------------
    def init_async(self, name: str, value: torch.Tensor) -> Handle:
        """Set the servers' value of `name` (resets its momentum, versions and backups)."""
        self._worker_only("init")
        e = self._check(name, value, "init")
        value = value.detach()
        req = self._client.init(e.key, value)
        return Handle(req, f"pycomm.ps.init('{name}') on rank {self.rank}",
                      on_ok=lambda: setattr(e, "initialized", True))

    def init(self, name: str, value: torch.Tensor) -> None:
        self.init_async(name, value).wait()

    def push_async(self, name: str, grad: torch.Tensor) -> Handle:
        """Send gradient `grad` of `name`; each server applies the update rule to its shard on arrival.
        `grad` must not be modified before the handle's wait()."""
        self._worker_only("push")
        e = self._check(name, grad, "push")
        if not e.initialized:
            raise ValueError(f"pycomm.ps.push('{name}') on rank {self.rank}: '{name}' has no value on the "
                             "servers yet as far as this worker knows; register() it, or init() / pull() it first")
        req = self._client.push(e.key, grad.detach())
        self.bytes_pushed += e.numel * 4
        return Handle(req, f"pycomm.ps.push('{name}') on rank {self.rank}")

    def push(self, name: str, grad: torch.Tensor) -> None:
        self.push_async(name, grad).wait()

    def pull_async(self, name: str, out: torch.Tensor) -> Handle:
        """Receive the servers' current value of `name` into `out` (complete after wait())."""
        self._worker_only("pull")
        e = self._check(name, out, "pull")
        req = self._client.pull(e.key, out.detach())
        self.bytes_pulled += e.numel * 4
        return Handle(req, f"pycomm.ps.pull('{name}') on rank {self.rank}",
                      on_ok=lambda: setattr(e, "initialized", True))

    def pull(self, name: str, out: torch.Tensor) -> None:
        self.pull_async(name, out).wait()

    def push_pull_async(self, name: str, grad: torch.Tensor, out: torch.Tensor) -> Handle:
        """push(name, grad) then pull(name, out) as one request (BytePS's push_pull): `out` receives the
        servers' value with this push applied, exactly as a push followed by a pull would give. The shard
        of this rank's own server is updated and copied out in one pass. `grad` and `out` must not be
        touched before the handle's wait(); they may not overlap."""
        self._worker_only("push_pull")
        e = self._check(name, grad, "push_pull")
        self._check(name, out, "push_pull")
        if not e.initialized:
            raise ValueError(f"pycomm.ps.push_pull('{name}') on rank {self.rank}: '{name}' has no value on the "
                             "servers yet as far as this worker knows; register() it, or init() / pull() it first")
        g = grad.detach()
        o = out.detach()
        if g.numel() and g.data_ptr() < o.data_ptr() + o.numel() * 4 and o.data_ptr() < g.data_ptr() + g.numel() * 4:
            raise ValueError(f"pycomm.ps.push_pull('{name}') on rank {self.rank}: grad and out share memory; "
                             "pass a separate output (the servers read grad while they write out)")
        req = self._client.push_pull(e.key, g, o)
        self.bytes_pushed += e.numel * 4
        self.bytes_pulled += e.numel * 4
        return Handle(req, f"pycomm.ps.push_pull('{name}') on rank {self.rank}")

    def push_pull(self, name: str, grad: torch.Tensor, out: torch.Tensor) -> None:
        self.push_pull_async(name, grad, out).wait()

    def flush(self) -> None:
        """Return once every server has served every request this worker sent before."""
        self._worker_only("flush")
        self._client.flush().wait()

    def clock(self) -> int:
        """SSP: advance this worker's clock to c + 1 and wait until every unfinished worker has reached
        c + 1 - s (s = staleness_bound). Pushes sent before are applied before any worker passes."""
        self._worker_only("clock")
        if self.staleness_bound is None:
            raise ValueError("pycomm.ps.clock(): this ParameterServer has no staleness_bound (SSP is off)")
        self.clock_value += 1
        self._client.clock(self.clock_value).wait()
        return self.clock_value

    def clock_pull(self, tensors: Dict[str, torch.Tensor]) -> int:
        """SSP's clock, answered with every registered tensor as the servers hold it at the moment the
        clock is granted (one consistent read per server). `tensors` maps every declared name to its
        output. With staleness_bound 0 every worker reads the same model after the same gradients: BSP."""
        self._worker_only("clock_pull")
        if self.staleness_bound is None:
            raise ValueError("pycomm.ps.clock_pull(): this ParameterServer has no staleness_bound (SSP is off)")
        missing = [n for n in self._entries if n not in tensors]
        extra = [n for n in tensors if n not in self._entries]
        if missing or extra:
            raise ValueError(f"pycomm.ps.clock_pull on rank {self.rank}: give exactly the declared tensors; "
                             f"missing {missing}, unknown {extra}")
        outs = []
        for n, e in self._entries.items():
            self._check(n, tensors[n], "clock_pull")
            if not e.initialized:
                raise ValueError(f"pycomm.ps.clock_pull('{n}') on rank {self.rank}: no value yet; register it")
            outs.append(tensors[n].detach())
            self.bytes_pulled += e.numel * 4
        self.clock_value += 1
        st = self._client.clock_pull(self.clock_value, outs).wait()
        if st != 0:
            raise CommError(f"pycomm.ps.clock_pull on rank {self.rank}: the servers hold other tensors than "
                            f"this worker declared ({_STATUS.get(st, st)})")
        return self.clock_value

    def barrier(self) -> None:
        """Workers only: flush, then wait for every worker."""
        self.flush()
        self.worker_comm.Barrier()

    # -- statistics ----------------------------------------------------------------
    def stats(self) -> dict:
        """Staleness per worker, summed over servers: each (push, shard) counts once.

        histogram[k][tau]: updates whose gradient was tau server updates old (last bin: >= 63)."""
        self._worker_only("stats")
        req = self._client.stats()
        if req.wait() != 0:
            raise CommError(f"pycomm.ps.stats on rank {self.rank}: a server refused")
        W = self.num_workers
        hist = np.zeros((W, HIST_BINS), dtype=np.int64)
        pushes = np.zeros(W, dtype=np.int64)
        total = np.zeros(W, dtype=np.int64)
        mx = np.zeros(W, dtype=np.int64)
        updates = 0
        for blob in req.payloads():
            a = np.frombuffer(blob, dtype=np.int64)
            per = a[:-1].reshape(W, HIST_BINS + 3)
            hist += per[:, :HIST_BINS]
            pushes += per[:, HIST_BINS]
            total += per[:, HIST_BINS + 1]
            mx = np.maximum(mx, per[:, HIST_BINS + 2])
            updates += int(a[-1])
        n = int(pushes.sum())
        return {"histogram": hist.tolist(), "pushes": pushes.tolist(),
                "mean_staleness_per_worker": [float(t / p) if p else 0.0 for t, p in zip(total, pushes)],
                "max_staleness_per_worker": mx.tolist(),
                "mean_staleness": float(total.sum() / n) if n else 0.0, "max_staleness": int(mx.max()) if W else 0,
                "shard_updates": updates}

    # -- state -----------------------------------------------------------------------
    def _my_servers(self) -> List[int]:
        return [j for j in range(self.num_servers) if j % self.num_workers == self.worker_index]

    def state_dict(self) -> dict:
        """Collective over workers. Worker i saves servers j with j mod W = i (co-located: its own), after
        every worker's requests were served, so the snapshot is consistent."""
        self._worker_only("state_dict")
        self.barrier()
        blobs = {}
        for j in self._my_servers():
            req = self._client.save(j)
            if req.wait() != 0:
                raise CommError(f"pycomm.ps.state_dict on rank {self.rank}: server {j} refused")
            blobs[j] = req.payloads()[0]
        self.worker_comm.Barrier()
        return {"servers": blobs, "clock": self.clock_value, "num_servers": self.num_servers,
                "num_workers": self.num_workers, "initialized": [n for n, e in self._entries.items() if e.initialized]}

    def load_state_dict(self, state: dict) -> None:
        self._worker_only("load_state_dict")
        if state["num_servers"] != self.num_servers or state["num_workers"] != self.num_workers:
            raise ValueError(f"pycomm.ps.load_state_dict: state of {state['num_workers']} workers and "
                             f"{state['num_servers']} servers; this job has {self.num_workers} and {self.num_servers}")
        missing = [j for j in self._my_servers() if j not in state["servers"]]
        if missing:
            raise ValueError(f"pycomm.ps.load_state_dict on worker {self.worker_index}: no state for servers "
                             f"{missing}; load the state this worker saved")
        self.barrier()
        for j in self._my_servers():
            if self._client.load(j, state["servers"][j]).wait() != 0:
                raise CommError(f"pycomm.ps.load_state_dict on rank {self.rank}: server {j} could not load its "
                                "state (see its message on stderr)")
        self.clock_value = int(state["clock"])
        for n in state["initialized"]:
            if n in self._entries:
                self._entries[n].initialized = True
        self.worker_comm.Barrier()

    # -- serving and shutdown --------------------------------------------------------
    def serve(self) -> None:
        """Dedicated server ranks: serve until every worker has called shutdown()."""
        if not self.is_server or self._threaded:
            raise CommError(f"pycomm.ps.serve on rank {self.rank}: only dedicated server ranks call serve()")
        self.shutdown()

    def shutdown(self) -> None:
        """Workers: flush, tell every server this worker is done, and (co-located) wait until every worker
        is done. Dedicated servers: serve until then. Idempotent."""
        if self._closed:
            return
        self._say_done()
        try:
            if self._threaded:
                self._server.join()
            elif not self.is_worker:
                self._server.run()
        except BaseException:
            # The servers have ended (a worker died): a second shutdown, e.g. at exit, has nobody to talk to.
            self._closed = True
            raise
        self._close()

    def _say_done(self) -> None:
        # A worker's half of shutdown(): once, so that a shutdown after it only waits for the servers.
        if self.is_worker and not self._said_done:
            self._client.flush().wait()
            self._client.done().wait()
            self._said_done = True

    def _close(self) -> None:
        self._closed = True
        if not mpi().Is_finalized():
            self.worker_comm.Free()
            self.comm.Free()
