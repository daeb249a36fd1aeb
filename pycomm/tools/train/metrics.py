"""Metrics of a training run: evaluation, per-epoch records, formatting, model fingerprint."""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024) -> float:
    """Top-1 accuracy in percent."""
    model.eval()
    correct = 0
    for i in range(0, x.shape[0], batch):
        correct += int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
    model.train()
    return 100.0 * correct / max(1, x.shape[0])


@torch.no_grad()
def mean_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, limit: int = 2048) -> float:
    """Mean cross-entropy of `model` on the first `limit` samples of (x, y)."""
    model.eval()
    out = model(x[:limit]).float()
    model.train()
    return float(torch.nn.functional.cross_entropy(out, y[:limit]))


def fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes: equal fingerprints mean bitwise-equal models."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} GiB"


def epoch_line(rec: dict, epochs: int) -> str:
    return (f"epoch {rec['epoch']:>3}/{epochs}  train_loss {rec['train_loss']:.4f}  "
            f"test_acc {rec['test_accuracy']:6.2f}%  syncs {rec['syncs']:>6}  "
            f"bytes_sent {human_bytes(rec['bytes_sent']):>10}  elapsed {rec['wall_time_s']:.1f}s")
