"""DistributedOptimizer: synchronize() / skip_synchronize() (Horovod's pattern) and the GradScaler recipe.

References are single-process training on the union of the ranks' batches.
"""
import copy

import numpy as np
import pytest
import torch
from torch import nn

import pycomm
from pycomm.optimizer import DistributedOptimizer

from optim_refs import measured

PER_RANK = 5


def make_model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))


def batch(step, n):
    rng = np.random.default_rng([31, step, n])
    x = torch.from_numpy(rng.normal(size=(n * PER_RANK, 7)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 3, size=n * PER_RANK))
    return x, y


def mine(x, y):
    r = pycomm.rank()
    return x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]


def max_diff(a, b):
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("mode", ["step", "synchronize_then_step", "skip_synchronize"])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_three_ways_reduce_once(mode, op):
    """step(); synchronize()+step(); synchronize()+clip+skip_synchronize step(): each bucket reduced once."""
    n = pycomm.size()
    model = make_model()
    ref = copy.deepcopy(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), op=op,
                               bucket_mb=0.0001)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps = 5
    for s in range(steps):
        x, y = batch(s, n)
        opt.zero_grad()
        nn.functional.cross_entropy(model(mine(x, y)[0]), mine(x, y)[1]).backward()
        if mode == "step":
            opt.step()
        elif mode == "synchronize_then_step":
            opt.synchronize()
            opt.synchronize()  # a second call within the iteration does not reduce again
            opt.step()
        else:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
        # reference: the union batch; op=sum is N times the average gradient
        ref_opt.zero_grad()
        loss = nn.functional.cross_entropy(ref(x), y) * (n if op == "sum" else 1)
        loss.backward()
        if mode == "skip_synchronize":
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
    assert opt.num_allreduces == steps * len(opt.buckets), \
        f"rank {pycomm.rank()}: {opt.num_allreduces} allreduces for {steps} steps of {len(opt.buckets)} buckets"
    # mean of N slice means against the mean of the union, float32: measured 0 (1 rank) to 3e-8
    # (2-4 ranks) over 5 steps; bound 3e-7. A second reduction would double the update (op=sum: N^2 g).
    assert measured(f"distopt_{mode}_{op}", max_diff(model, ref)) <= 3e-7


def test_onebit_residuals_not_polluted_by_synchronize_then_step():
    """With onebit compression, synchronize()+step() gives bitwise what step() alone gives."""
    n = pycomm.size()
    results = []
    for mode in ("step", "synchronize_then_step"):
        model = make_model()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression="onebit")
        for s in range(4):
            x, y = batch(s, n)
            opt.zero_grad()
            nn.functional.cross_entropy(model(mine(x, y)[0]), mine(x, y)[1]).backward()
            if mode != "step":
                opt.synchronize()
            opt.step()
        results.append((model, opt.state_dict()["pycomm_compression"]))
    (a, ca), (b, cb) = results
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for k in ca["residuals"]:
        assert torch.equal(ca["residuals"][k]["worker"], cb["residuals"][k]["worker"])


def test_skip_synchronize_without_synchronize_is_an_error():
    n = pycomm.size()
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x, y = batch(0, n)
    nn.functional.cross_entropy(model(mine(x, y)[0]), mine(x, y)[1]).backward()
    with pytest.raises(RuntimeError, match="call opt.synchronize\\(\\) before the skip_synchronize\\(\\) block"):
        with opt.skip_synchronize():
            opt.step()
    opt.synchronize()  # the reductions started by the hooks complete on every rank


def run_amp(distributed, steps, inject_inf_rank=None):
    """fp32 model, bf16 autocast forward on the CPU, torch.amp.GradScaler, Horovod's recipe."""
    n = pycomm.size()
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    opt = DistributedOptimizer(base, model.named_parameters()) if distributed else base
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)
    scales, skipped = [], []
    for s in range(steps):
        x, y = batch(s, n)
        if distributed:
            x, y = mine(x, y)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        hook = None
        if inject_inf_rank is not None and s == 2 and pycomm.rank() == inject_inf_rank:
            # before the gradient reaches the reduction hooks, as a real overflow would
            hook = model[0].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("inf")))
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        before = [p.detach().clone() for p in model.parameters()]
        if distributed:
            opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        if distributed:
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    return model, scales, skipped, opt


def test_grad_scaler_recipe_matches_single_process_amp():
    model, scales, skipped, opt = run_amp(True, 8)
    ref, ref_scales, _, _ = run_amp(False, 8)
    assert scales == ref_scales and not any(skipped)
    assert scales[-1] > 2.0 ** 12  # grew after 3 clean steps
    assert opt.num_allreduces == 8 * len(opt.buckets)
    # bf16 autocast: per-rank forward/backward rounding differs from the union's (bf16 sums over
    # different batches); measured max deviation 8.2e-4..1.5e-3 after 8 steps at 2-4 ranks (0 at 1 rank).
    err = max_diff(model, ref)
    assert measured("amp", err) <= 5e-3, f"rank {pycomm.rank()}: AMP with DistributedOptimizer deviates by {err:.3g}"


def test_grad_scaler_inf_on_one_rank_skips_everywhere():
    n = pycomm.size()
    _, scales, skipped, _ = run_amp(True, 4, inject_inf_rank=n - 1)
    assert skipped == [False, False, True, False], f"rank {pycomm.rank()}: skipped {skipped}"
    assert scales[2] == scales[1] * 0.5
