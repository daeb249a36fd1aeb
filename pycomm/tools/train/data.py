"""Datasets for pycomm-train and their per-rank shards.

``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10
classes, no download; the CSV is read directly, which is faster than
importing scikit-learn), pixels scaled to [0, 1], split 80/20 stratified
with a fixed seed. ``synthetic``: a deterministic 10-class Gaussian-mixture task
of 8x8 "images". ``synthetic-large``: the same
task with noise 3 (harder), 16,384 training and 10,000 test samples. ``npz:PATH``: arrays ``x_train, y_train, x_test, y_test``
(features (N, D), (N, H, W) or (N, C, H, W); integer labels 0..C-1).

Sharding: each epoch draws one permutation of the training set from
(seed, epoch), drops the last ``n mod N`` samples so that every rank gets
the same number, and gives rank k the k-th contiguous slice. Every rank
computes the same permutation; no communication is needed.
``--every-sample`` keeps every sample instead: the first ``n mod N`` ranks
take one more, so a rank may have one batch fewer and joins (pycomm.join).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Tuple

import numpy as np
import torch


class DataError(ValueError):
    """Bad dataset specification or file."""


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _digits_array() -> np.ndarray:
    """scikit-learn's digits.csv.gz (64 pixels + label per row), read without importing scikit-learn."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("--dataset digits needs scikit-learn, which bundles it: pip install 'pycomm[train]' "
                        "(or pip install scikit-learn); --dataset synthetic needs nothing more")
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return np.loadtxt(path, delimiter=",", dtype=np.float64)
    from sklearn.datasets import load_digits  # a layout we do not know: let scikit-learn find it

    d = load_digits()
    return np.concatenate([d.data, d.target[:, None]], axis=1)


def _digits() -> Dataset:
    raw = _digits_array()
    x = (raw[:, :64] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = raw[:, 64].astype(np.int64)
    # Stratified 80/20 split with a fixed seed: 20% of every class (rounded) goes to the test set.
    rng = np.random.default_rng(0)
    test = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test.extend(idx[:int(round(0.2 * len(idx)))])
    test_mask = np.zeros(len(y), dtype=bool)
    test_mask[test] = True
    return Dataset("digits", torch.from_numpy(x[~test_mask]), torch.from_numpy(y[~test_mask]),
                   torch.from_numpy(x[test_mask]), torch.from_numpy(y[test_mask]), 10)


def _synthetic(n_train: int = 4096, n_test: int = 1024, classes: int = 10, noise: float = 1.5,
               name: str = "synthetic") -> Dataset:
    rng = np.random.default_rng(12345)
    protos = rng.normal(0.0, 1.0, size=(classes, 1, 8, 8)).astype(np.float32)

    def draw(n):
        y = rng.integers(0, classes, size=n)
        x = protos[y] + rng.normal(0.0, noise, size=(n, 1, 8, 8)).astype(np.float32)
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))

    xtr, ytr = draw(n_train)
    xte, yte = draw(n_test)
    return Dataset(name, xtr, ytr, xte, yte, classes)


NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _npz(path: str) -> Dataset:
    if not path:
        raise DataError("--dataset npz:PATH needs a path, e.g. npz:data/mnist.npz")
    if not os.path.isfile(path):
        raise DataError(f"npz file {path!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as f:
            keys = list(f.keys())
            missing = [k for k in NPZ_KEYS if k not in keys]
            if missing:
                raise DataError(f"npz file {path!r} lacks array(s) {', '.join(missing)}; it has {keys or 'none'}; "
                                f"expected {', '.join(NPZ_KEYS)}")
            arrays = {k: f[k] for k in NPZ_KEYS}
    except DataError:
        raise
    except Exception as e:  # zipfile.BadZipFile, ValueError (pickled object arrays), OSError
        raise DataError(f"cannot read npz file {path!r}: {type(e).__name__}: {e}") from None
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype.kind not in "fiub":
            raise DataError(f"{path}: x_{split} has dtype {x.dtype}; expected numbers")
        if y.dtype.kind not in "iu":
            raise DataError(f"{path}: y_{split} has dtype {y.dtype}; expected integer class labels")
        if x.ndim not in (2, 3, 4):
            raise DataError(f"{path}: x_{split} has shape {x.shape}; expected (N, D), (N, H, W) or (N, C, H, W)")
        if y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise DataError(f"{path}: y_{split} has shape {y.shape}, x_{split} has {x.shape}; "
                            f"expected y of shape ({x.shape[0]},)")
        if x.shape[0] == 0:
            raise DataError(f"{path}: x_{split} is empty")
        if y.min() < 0:
            raise DataError(f"{path}: y_{split} has negative labels; expected 0..C-1")
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            raise DataError(f"{path}: x_{split} contains NaN or inf")
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        raise DataError(f"{path}: x_train samples have shape {arrays['x_train'].shape[1:]}, "
                        f"x_test samples {arrays['x_test'].shape[1:]}")
    xtr, xte = arrays["x_train"], arrays["x_test"]
    if xtr.ndim == 3:
        xtr, xte = xtr[:, None], xte[:, None]
    classes = int(max(arrays["y_train"].max(), arrays["y_test"].max())) + 1
    return Dataset(f"npz:{path}", torch.from_numpy(np.ascontiguousarray(xtr, dtype=np.float32)),
                   torch.from_numpy(arrays["y_train"].astype(np.int64)),
                   torch.from_numpy(np.ascontiguousarray(xte, dtype=np.float32)),
                   torch.from_numpy(arrays["y_test"].astype(np.int64)), classes)


def load_dataset(spec: str) -> Dataset:
    """digits | synthetic | npz:PATH."""
    if spec == "digits":
        return _digits()
    if spec == "synthetic":
        return _synthetic()
    if spec == "synthetic-large":  # harder (noise 3) and a 10,000-sample test set: one point = 100 samples
        return _synthetic(16384, 10000, noise=3.0, name="synthetic-large")
    if spec.startswith("npz:"):
        return _npz(spec[4:])
    raise DataError(f"unknown dataset {spec!r}; choose digits, synthetic, synthetic-large or npz:PATH")


def shard_size(n_train: int, world_size: int) -> int:
    return n_train // world_size


def epoch_shard(n_train: int, world_size: int, rank: int, seed: int, epoch: int) -> np.ndarray:
    """Indices of rank `rank`'s shard in `epoch`: a slice of one (seed, epoch) permutation."""
    perm = np.random.default_rng([seed, epoch]).permutation(n_train)
    per = shard_size(n_train, world_size)
    return perm[rank * per:(rank + 1) * per]


def every_sample_shard(n_train: int, world_size: int, rank: int, seed: int, epoch: int) -> np.ndarray:
    """Rank `rank`'s shard when every sample is used: contiguous slices of the (seed, epoch) permutation
    whose sizes differ by at most one (the first n_train % world_size ranks take one more)."""
    perm = np.random.default_rng([seed, epoch]).permutation(n_train)
    base, rem = divmod(n_train, world_size)
    begin = rank * base + min(rank, rem)
    return perm[begin:begin + base + (1 if rank < rem else 0)]


def steps_per_epoch(n_train: int, world_size: int, batch_size: int) -> int:
    """Minibatches per rank per epoch (the last one may be smaller, equally on every rank)."""
    per = shard_size(n_train, world_size)
    return (per + batch_size - 1) // batch_size


def check_batch(n_train: int, world_size: int, batch_size: int) -> None:
    if batch_size < 1:
        raise DataError(f"--batch-size must be at least 1, got {batch_size}")
    per = shard_size(n_train, world_size)
    if batch_size > per:
        raise DataError(f"--batch-size {batch_size} is larger than a rank's shard ({per} samples = "
                        f"{n_train} training samples / {world_size} ranks); use --batch-size {per} or less")
