"""Training with compressed gradients through DistributedOptimizer: onebit (error feedback) ends
within 3.5% of the uncompressed run's final loss; fp16/bf16 within 0.6%.

Plain SGD: 1-bit compression of the *gradient* with heavy-ball momentum on top
lags behind (measured here: +13% to +38% final loss with momentum 0.9), which
is why DeepSpeed's 1-bit Adam compresses the momentum instead."""
import time

import numpy as np
import pytest
import torch
from torch import nn

import pycomm
from pycomm.optimizer import DistributedOptimizer

PER_RANK = 32
STEPS = 600
LR = 0.2


def dataset(count=2048):
    """A fixed classification task: labels from a random teacher network (learnable, not trivial)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(count, 20, generator=g)
    teacher = torch.randn(20, 5, generator=g)
    y = (torch.tanh(x @ teacher) + 0.3 * torch.randn(count, 5, generator=g)).argmax(1)
    return x, y


DATA = dataset()


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def train(compression, steps=STEPS):
    n, r = pycomm.size(), pycomm.rank()
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               model.named_parameters(), compression=compression)
    x, y = DATA
    for s in range(steps):
        idx = torch.from_numpy(np.random.default_rng([5, s]).choice(len(x), n * PER_RANK, replace=False))
        mine = idx[r * PER_RANK:(r + 1) * PER_RANK]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
    with torch.no_grad():
        loss = float(nn.functional.cross_entropy(model(x), y))
    return loss, model, opt


_BASELINE = {}


def baseline():
    if "loss" not in _BASELINE:
        _BASELINE["loss"] = train("none")[0]
    return _BASELINE["loss"]


# Measured at 4 ranks (pytest -s prints them): onebit -2.1%, fp16 -0.0%, bf16 +0.3% from the
# uncompressed final loss; bounds 3.5% and 0.6%.
@pytest.mark.parametrize("compression,tolerance", [("onebit", 0.035), ("fp16", 0.006), ("bf16", 0.006)])
def test_final_loss_close_to_uncompressed(compression, tolerance, comm):
    if pycomm.size() != 4:
        pytest.skip("the convergence comparison runs at 4 ranks (the harness runs this file at 1..4)")
    t0 = time.perf_counter()
    loss, model, opt = train(compression)
    base = baseline()
    if pycomm.rank() == 0:
        print(f"\n{compression}: final loss {loss:.4f}, uncompressed {base:.4f} "
              f"({(loss / base - 1) * 100:+.1f}%), {time.perf_counter() - t0:.1f} s, "
              f"{opt.bytes_sent} bytes sent")
    assert abs(loss - base) <= tolerance * base, (
        f"{compression}: final loss {loss:.4f} vs uncompressed {base:.4f} (more than {tolerance:.0%} apart)")
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
    assert all(p == params for p in comm.allgather(params)), "ranks hold different models"


def test_onebit_residuals_are_in_the_optimizer_state_dict():
    loss, model, opt = train("onebit", steps=3)
    sd = opt.state_dict()
    comp = sd["pycomm_compression"]
    assert comp["compression"] == "onebit" and comp["world_size"] == pycomm.size()
    names = sorted(comp["residuals"])
    assert names == [f"DistributedOptimizer.bucket{i}" for i in range(len(opt.buckets))]
    worker = comp["residuals"][names[0]]["worker"]
    assert worker.numel() == sum(p.numel() for p in model.parameters()) and worker.abs().sum() > 0
    # load into a fresh optimizer: the residuals come back exactly
    model2 = make_model()
    opt2 = DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=LR),
                                model2.named_parameters(), compression="onebit")
    opt2.load_state_dict(sd)
    for name in names:
        for a, b in zip(opt.compressor.residuals(name), opt2.compressor.residuals(name)):
            assert torch.equal(a, b)
