"""Deterministic per-rank test data and float64 references."""
import os

import numpy as np
import torch


def shared_seed(comm) -> int:
    """A fresh random seed, the same on every rank of mpi4py communicator `comm`."""
    return comm.bcast(int.from_bytes(os.urandom(4), "little") if comm.Get_rank() == 0 else None, root=0)


def rank_data(rank: int, count: int, dtype: torch.dtype, seed: int = 0, scale: float = 100.0) -> torch.Tensor:
    """Data rank `rank` contributes; any rank can recompute any other's."""
    rng = np.random.default_rng([seed, rank, count])
    if dtype in (torch.int32, torch.int64):
        x = rng.integers(-1000, 1000, size=count)
    else:
        x = rng.uniform(-scale, scale, size=count)
    return torch.from_numpy(x).to(dtype)


def reference(op: str, size: int, count: int, dtype: torch.dtype, seed: int = 0) -> np.ndarray:
    """float64 result of reducing every rank's rank_data with `op`."""
    stack = np.stack([rank_data(r, count, dtype, seed).double().numpy() for r in range(size)])
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.mean(0)
    if op == "min":
        return stack.min(0)
    if op == "max":
        return stack.max(0)
    raise ValueError(op)


def magnitude(size: int, count: int, dtype: torch.dtype, seed: int = 0) -> np.ndarray:
    """sum_k |x_k|: the scale against which a sum's rounding error is bounded."""
    return np.stack([np.abs(rank_data(r, count, dtype, seed).double().numpy()) for r in range(size)]).sum(0)


def tolerance(dtype: torch.dtype, size: int) -> float:
    """Error bound of an N-term sum in `dtype`, relative to magnitude()."""
    eps = {torch.float32: 2 ** -24, torch.float64: 2 ** -53, torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}
    return 0.0 if dtype in (torch.int32, torch.int64) else 2 * size * eps[dtype]


def assert_close(result: torch.Tensor, op: str, size: int, dtype: torch.dtype, seed: int = 0, what: str = "") -> None:
    count = result.numel()
    ref = reference(op, size, count, dtype, seed)
    got = result.double().numpy().reshape(-1)
    if op in ("min", "max") or dtype in (torch.int32, torch.int64):
        bad = np.flatnonzero(got != ref)
    else:
        bound = tolerance(dtype, size) * magnitude(size, count, dtype, seed) / (size if op == "avg" else 1)
        bound += np.abs(ref) * tolerance(dtype, 1)  # the final rounding (and the 1/N scaling)
        bad = np.flatnonzero(np.abs(got - ref) > bound)
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} of {count} elements wrong; first at {i}: got {got[i]!r}, "
                             f"expected {ref[i]!r}")


def assert_not_grown_past(before: int, after: int, bound: int, what: str = "") -> None:
    """Grow-only engine memory (the shm window, the peer block: a pycomm.stats() size) read after a call:
    the call grew it to at most `bound` bytes, or left it as it was. It never shrinks, and an earlier
    test in the same process (tests/test_parallel.py runs a group of files in one) may have grown it past
    `bound` already."""
    assert after <= max(before, bound), f"{what}: grown from {before} to {after} bytes, past {bound}"
