"""PowerSGD: rank-r gradient compression with warm start and error feedback (docs/algorithms.md §5b).

Per 2-D gradient M (n x m; a tensor of higher dimension is viewed as
shape[0] x prod(shape[1:])) with this rank's residual E and the warm-start
matrix Q (m x r, the same on every rank)::

    M <- M + E
    P = M Q;          allreduce P (average)
    P <- orthonormal columns of P (Gram-Schmidt; a column that vanishes becomes 0)
    Q = M^T P;        allreduce Q (average)
    M_hat = P Q^T     (the result; times N for op="sum")
    E <- M - M_hat    (error feedback: what was not sent waits for the next step)

Q is kept as the next step's starting point (one power iteration per step,
warm-started: Vogels et al. 2019). Its first value is drawn from N(0, 1) with
a seed derived from ``seed``, the tensor name and the piece index
(:meth:`PowerSGD.initial_q`), identical on every rank.

Tensors sent exactly: 1-D pieces (biases, norms) and 2-D pieces too small to
gain (r (n + m) >= n m) go through the first allreduce uncompressed, with no
residual. All pieces of one call travel in two allreduces: [exact pieces, P's]
and [Q's].

A flat buffer that holds several tensors (a DistributedOptimizer or DDP
bucket) is described with :meth:`Compressor.set_layout`; without a layout
the tensor's own shape is the one piece.
"""
from __future__ import annotations

import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _C, _ops
from ..compression import Float32Compressor, InFlightByName
from ..runtime import size


def orthogonalize_(p: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of p (in place): p^T p = I, except columns that vanish, which become 0."""
    for j in range(p.shape[1]):
        col = p[:, j]
        if j:
            prev = p[:, :j]
            col -= prev @ (prev.t() @ col)
        norm = torch.linalg.vector_norm(col)
        if norm > 0 and torch.isfinite(norm):
            col /= norm
        else:
            col.zero_()
    return p


class _Piece:
    __slots__ = ("offset", "numel", "rows", "cols", "compressed")

    def __init__(self, offset: int, shape: Tuple[int, ...], rank: int):
        self.offset = offset
        self.numel = 1
        for d in shape:
            self.numel *= int(d)
        self.rows = int(shape[0]) if len(shape) >= 1 else 1
        self.cols = self.numel // self.rows if self.rows else 0
        r = min(rank, self.rows, self.cols)
        # 2-D (or more) and rank r smaller than both sides and than the element count.
        self.compressed = len(shape) >= 2 and r > 0 and r * (self.rows + self.cols) < self.numel


class _State:
    __slots__ = ("layout", "residual", "qs")

    def __init__(self, layout, residual, qs):
        self.layout, self.residual, self.qs = layout, residual, qs


class PowerSGD(InFlightByName, Float32Compressor):
    """Rank-r PowerSGD with warm start and error feedback.

    rank [1]: columns of P and Q (torch's PowerSGD hook defaults to 1; Vogels
    et al. report rank 2 matching full precision on ResNet-18/CIFAR-10).
    seed [0]: seed of the first Q (the same on every rank).

    Bytes per rank and step: two float32 allreduces, of sum_i r n_i + (exact
    elements) and of sum_i r m_i, instead of one of sum_i n_i m_i.

    State (per tensor name, in ``state_dict()``): this rank's residual (the
    tensor's size) and the Q's (shared by all ranks). Resuming from it continues
    bitwise as if never stopped. A name whose layout changes starts afresh
    (``layout_resets`` counts these).

    Refuses: dtypes other than float32 (TypeError), ops other than avg/sum,
    tensors on devices other than CPU/CUDA, calls without ``name`` (ValueError).
    """

    name = "powersgd"
    kept_per_name = "the residual and the warm-start Q"

    def __init__(self, rank: int = 1, seed: int = 0, q_group=None):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd: rank must be a positive integer, got {rank!r}")
        self.rank = rank
        self.seed = int(seed)
        self.q_group = q_group  # pycomm.ProcessGroup for the Q allreduce (None: the world engine)
        self._layouts: Dict[str, Tuple[Tuple[int, ...], ...]] = {}
        self._states: Dict[str, _State] = {}
        self._init_pending()
        self._last_pieces: Dict[str, List[_Piece]] = {}
        self.layout_resets = 0

    @classmethod
    def from_spec(cls, param: str) -> "PowerSGD":
        try:
            rank = int(param)
        except ValueError:
            raise ValueError(f"powersgd: the parameter after ':' is the rank, an integer; got {param!r}") from None
        return cls(rank=rank)

    # ---- layout and state ----
    def set_layout(self, name: str, shapes: Sequence[Sequence[int]]) -> None:
        layout = tuple(tuple(int(d) for d in s) for s in shapes)
        if self._layouts.get(name) == layout:
            return
        self._wait_pending()
        old = self._states.get(name)
        if old is not None and old.layout != layout:
            del self._states[name]  # one tensor's residual must not feed another
            self.layout_resets += 1
        self._layouts[name] = layout

    @staticmethod
    def initial_q(seed: int, name: str, index: int, cols: int, rank: int) -> torch.Tensor:
        """The first Q (cols x rank) of piece `index` of tensor `name`: N(0, 1), float32, the same on every rank."""
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + index) % (1 << 62))
        return torch.randn(cols, rank, generator=g, dtype=torch.float32)

    def pieces(self, name: str, tensor_shape: Sequence[int]) -> List[_Piece]:
        layout = self._layouts.get(name) or (tuple(int(d) for d in tensor_shape),)
        out, offset = [], 0
        for shape in layout:
            p = _Piece(offset, shape, self.rank)
            out.append(p)
            offset += p.numel
        return out

    def _state_for(self, name: str, tensor: torch.Tensor) -> Tuple[_State, List[_Piece]]:
        pieces = self.pieces(name, tensor.shape)
        total = sum(p.numel for p in pieces)
        if total != tensor.numel():
            raise ValueError(f"powersgd: tensor '{name}' has {tensor.numel()} elements but its layout "
                             f"{list(self._layouts.get(name, ()))} holds {total}; call set_layout('{name}', shapes) "
                             "with the shapes of the tensors it holds")
        layout = self._layouts.get(name) or (tuple(int(d) for d in tensor.shape),)
        st = self._states.get(name)
        if st is not None and (st.layout != layout or st.residual.numel() != tensor.numel()):
            if st.residual.numel() != tensor.numel() and name not in self._layouts:
                raise ValueError(f"powersgd: tensor '{name}' has {tensor.numel()} elements but its state was made "
                                 f"for {st.residual.numel()}; names must be unique per tensor (or call "
                                 f"reset('{name}'))")
            st = None
            self.layout_resets += 1
        dev = tensor.device
        if st is None:
            qs = [self.initial_q(self.seed, name, i, p.cols, min(self.rank, p.rows, p.cols)).to(dev)
                  if p.compressed else None for i, p in enumerate(pieces)]
            st = _State(layout, torch.zeros(tensor.numel(), dtype=torch.float32, device=dev), qs)
            self._states[name] = st
        elif st.residual.device != dev:  # the state follows its tensor
            st.residual = st.residual.to(dev)
            st.qs = [None if q is None else q.to(dev) for q in st.qs]
        return st, pieces

    def state_dict(self) -> Dict[str, Any]:
        self._wait_pending()
        return {"compression": self.name, "rank": self.rank, "seed": self.seed,
                "state": {k: {"layout": [list(s) for s in st.layout], "residual": st.residual.clone(),
                              "qs": [None if q is None else q.clone() for q in st.qs]}
                          for k, st in self._states.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        if int(state.get("rank", self.rank)) != self.rank:
            raise ValueError(f"powersgd: state_dict was saved with rank {state['rank']}, this compressor has rank "
                             f"{self.rank}; build PowerSGD(rank={state['rank']}) to resume it")
        self._wait_pending()
        self.seed = int(state.get("seed", self.seed))
        self._states = {}
        for k, v in state.get("state", {}).items():
            layout = tuple(tuple(int(d) for d in s) for s in v["layout"])
            self._states[k] = _State(layout, v["residual"].detach().to(torch.float32).reshape(-1).clone(),
                                     [None if q is None else q.detach().to(torch.float32).clone() for q in v["qs"]])

    def reset(self, name: Optional[str] = None) -> None:
        self._wait_pending()
        if name is None:
            self._states.clear()
        else:
            self._states.pop(name, None)

    def residual(self, name: str) -> Optional[torch.Tensor]:
        st = self._states.get(name)
        return None if st is None else st.residual

    def qs(self, name: str) -> Optional[List[Optional[torch.Tensor]]]:
        st = self._states.get(name)
        return None if st is None else st.qs

    # ---- the collective ----
    def _wire(self, pieces: List[_Piece], world: int, rank: int) -> int:
        first = sum(p.numel if not p.compressed else min(self.rank, p.rows, p.cols) * p.rows for p in pieces)
        second = sum(min(self.rank, p.rows, p.cols) * p.cols for p in pieces if p.compressed)
        return sum(int(_C.ring_wire_bytes(c, 4, world, rank)) for c in (first, second) if c)

    def wire_bytes(self, numel: int, world_size: int, rank: int = 0) -> int:
        """Bytes `rank` sends for one 1-D tensor of `numel` elements (sent exactly)."""
        return int(_C.ring_wire_bytes(numel, 4, world_size, rank)) if numel else 0

    def wire_bytes_named(self, name: Optional[str], numel: int, world_size: int, rank: int = 0) -> int:
        """Bytes `rank` sent in the last allreduce of `name` (by its pieces), else as one exact tensor."""
        if name and name in self._last_pieces:
            return self._wire(self._last_pieces[name], world_size, rank)
        if name and name in self._layouts:
            return self._wire(self.pieces(name, (numel,)), world_size, rank)
        return self.wire_bytes(numel, world_size, rank)

    def allreduce_async(self, tensor, op="avg", name=None, out=None, _blocking=False):
        self.check(tensor, op, name)
        self._check_out(tensor, out, name)
        self._wait_previous(name)
        st, pieces = self._state_for(name, tensor)
        self._last_pieces[name] = pieces
        h = _Handle(self, name, st, pieces, tensor, out if out is not None else tensor, op)
        self._track(name, h)
        if _blocking:
            h.wait()
        return h


class _Handle:
    """Phase 1 (exact pieces and P's) is in flight; wait() orthogonalizes, runs phase 2 (Q's) and writes the result."""

    def __init__(self, c: PowerSGD, name: str, st: _State, pieces: List[_Piece], tensor: torch.Tensor,
                 out: torch.Tensor, op: str):
        self._c, self._name, self._st, self._pieces, self._out, self._op = c, name, st, pieces, out, op
        self._result: Optional[torch.Tensor] = None
        with torch.no_grad():
            # M <- M + E (float32), for every piece; the exact pieces have E = 0.
            self._acc = tensor.reshape(-1).to(torch.float32) + st.residual
            parts = []
            for p in pieces:
                if not p.compressed:
                    parts.append(self._acc[p.offset:p.offset + p.numel])
            for i, p in enumerate(pieces):
                if p.compressed:
                    m = self._acc[p.offset:p.offset + p.numel].view(p.rows, p.cols)
                    parts.append((m @ st.qs[i]).reshape(-1))
            self._phase1 = torch.cat(parts) if parts else self._acc[:0].clone()
        self._h1 = (_ops.allreduce_async(self._phase1, op="avg", name=f"{name}.powersgd.p")
                    if self._phase1.numel() else None)

    def done(self) -> bool:
        return self._result is not None

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        try:
            self._finish()
        finally:
            self._c._untrack(self._name, self)
        return self._result

    def _finish(self) -> None:
        st, pieces, acc = self._st, self._pieces, self._acc
        if self._h1 is not None:
            self._h1.wait()
        world = size()
        with torch.no_grad():
            reduced = self._phase1
            result = torch.empty_like(acc)
            off = 0
            for p in pieces:
                if not p.compressed:
                    result[p.offset:p.offset + p.numel] = reduced[off:off + p.numel]
                    off += p.numel
            ps: List[Optional[torch.Tensor]] = [None] * len(pieces)
            qparts = []
            for i, p in enumerate(pieces):
                if p.compressed:
                    r = st.qs[i].shape[1]
                    ps[i] = orthogonalize_(reduced[off:off + p.rows * r].view(p.rows, r).clone())
                    off += p.rows * r
                    m = acc[p.offset:p.offset + p.numel].view(p.rows, p.cols)
                    qparts.append((m.t() @ ps[i]).reshape(-1))
            if qparts:
                qbuf = torch.cat(qparts)
                gid = self._c.q_group.id if self._c.q_group is not None else 0
                _ops.allreduce_async(qbuf, op="avg", name=f"{self._name}.powersgd.q", gid=gid).wait()
                off = 0
                for i, p in enumerate(pieces):
                    if p.compressed:
                        r = ps[i].shape[1]
                        q = qbuf[off:off + p.cols * r].view(p.cols, r).clone()
                        off += p.cols * r
                        st.qs[i] = q  # warm start of the next step
                        result[p.offset:p.offset + p.numel] = (ps[i] @ q.t()).reshape(-1)
            # E <- M - M_hat (the average's approximation); exact pieces leave no residual.
            new_res = acc - result
            for p in pieces:
                if not p.compressed:
                    new_res[p.offset:p.offset + p.numel] = 0
            st.residual = new_res
            if self._op == "sum":
                result *= world
            self._out.copy_(result.view_as(self._out))
        self._result = self._out
