"""Small classifiers for pycomm-train: ``mlp`` and ``cnn``."""
from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import nn

MODELS = ("mlp", "cnn")


class MLP(nn.Module):
    def __init__(self, input_shape: Tuple[int, ...], num_classes: int, hidden: int = 128):
        super().__init__()
        d = math.prod(input_shape)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self, input_shape: Tuple[int, ...], num_classes: int):
        super().__init__()
        c = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Linear(32 * 4, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


def build_model(name: str, input_shape: Tuple[int, ...], num_classes: int) -> nn.Module:
    if name == "mlp":
        return MLP(input_shape, num_classes)
    if name == "cnn":
        if len(input_shape) != 3:
            raise ValueError(f"--model cnn needs image inputs (N, C, H, W) or (N, H, W); this dataset's samples "
                             f"have shape {tuple(input_shape)}; use --model mlp")
        return SmallCNN(input_shape, num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
