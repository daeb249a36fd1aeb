"""OneBitAdam and OneBitLAMB: warm-up against torch / numpy, compression stage against a numpy model of
DeepSpeed's two-phase scheme, resume, and misuse.

The compression-stage checks are one-step checks at every one of 20 steps:
before each step every rank's local gradient and residuals are gathered with
mpi4py, the numpy model computes the step from the optimizer's state, and
the weights, momenta and this rank's residuals after pycomm's step must
match it. So each step's math and the evolution of the error feedback are
checked, without a reference that drifts on its own.
"""
import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

import pycomm
from pycomm.optim import OneBitAdam, OneBitLAMB

from optim_refs import measured, onebit_adam_step, onebit_lamb_step

PER_RANK = 6
DEAD = 3  # inputs 0..2 are always 0: their first-layer weights never get a gradient (frozen v = 0)


def make_model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(9, 11), nn.Tanh(), nn.Linear(11, 3))  # 146 parameters: not a multiple of 8N


def batch(step, n):
    rng = np.random.default_rng([23, step, n])
    x = rng.normal(size=(n * PER_RANK, 9)).astype(np.float32)
    x[:, :DEAD] = 0.0
    x = torch.from_numpy(x)
    y = torch.from_numpy(rng.integers(0, 3, size=n * PER_RANK))
    return x, y


def local_backward(model, step):
    n, r = pycomm.size(), pycomm.rank()
    x, y = batch(step, n)
    sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
    model.zero_grad()
    nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()


def flat(ts):
    return torch.cat([t.detach().reshape(-1) for t in ts]).numpy().astype(np.float32)


def gather(comm, arr):
    return [np.asarray(a, np.float32) for a in comm.allgather(np.asarray(arr, np.float32))]


def assert_same_on_all_ranks(tensors):
    f = torch.cat([t.detach().reshape(-1) for t in tensors])
    lo, hi = f.clone(), f.clone()
    pycomm.allreduce(lo, op="min")
    pycomm.allreduce(hi, op="max")
    assert torch.equal(lo, hi), f"rank {pycomm.rank()}: ranks differ"


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_onebit_adam_warmup_is_torch_adam_on_averaged_gradients(wd):
    """freeze_step beyond the run: 20 steps equal torch Adam (AdamW with weight decay) on the union batch."""
    n = pycomm.size()
    model = make_model()
    ref = copy.deepcopy(model)
    opt = OneBitAdam(model.parameters(), lr=0.01, weight_decay=wd, freeze_step=1000)
    ref_opt = (torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=wd) if wd
               else torch.optim.Adam(ref.parameters(), lr=0.01))
    for s in range(20):
        local_backward(model, s)
        opt.step()
        x, y = batch(s, n)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    err = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
    # The only difference is the gradient: mean of N slice means (pycomm float32 allreduce) against the
    # mean over the union; measured max deviation 0 at 1 rank, 4.5e-8..1.04e-7 at 2-4 ranks after 20
    # steps (weights move by ~0.1); bound 1e-6.
    assert measured("adam_warmup", err) <= 1e-6, f"rank {pycomm.rank()}: OneBitAdam warm-up deviates from torch Adam by {err:.3g}"
    assert opt.bytes_sent_compressed == 0
    assert_same_on_all_ranks(list(model.parameters()))


@pytest.mark.parametrize("bias_correction", [True, False])
def test_onebit_adam_matches_numpy_model(comm, bias_correction):
    n, r = pycomm.size(), pycomm.rank()
    model = make_model()
    params = list(model.parameters())
    hp = dict(b1=0.9, b2=0.999, eps=1e-8, lr=0.01, wd=0.01, bias_correction=bias_correction,
              shapes=[tuple(p.shape) for p in params])  # the variance floor is per tensor
    freeze = 4
    opt = OneBitAdam(params, lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=hp["wd"],
                     freeze_step=freeze, bias_correction=bias_correction)
    total = sum(p.numel() for p in params)
    _, chunk = pycomm._C.onebit_layout(total, n)
    for t in range(1, 21):
        local_backward(model, t)
        grads = gather(comm, flat([p.grad for p in params]))
        w = flat(params)
        if opt.state:
            m, v = flat([opt.state[p]["exp_avg"] for p in params]), flat([opt.state[p]["exp_avg_sq"] for p in params])
        else:
            m, v = np.zeros(total, np.float32), np.zeros(total, np.float32)
        res = opt.compressor.residuals("OneBitAdam.exp_avg")
        we = res[0].numpy().copy() if res else np.zeros(total, np.float32)
        se = res[1].numpy().copy() if res else np.zeros(chunk, np.float32)
        wres, sres = gather(comm, we), gather(comm, se)
        w2, m2, v2, wres2, sres2 = onebit_adam_step(w, m, v, grads, wres, sres, t, freeze, hp)
        opt.step()
        # one float32 step against the numpy model (PYCOMM_TEST_MEASURE=1, 1-4 ranks): weights <= 4.8e-7,
        # momentum and residuals <= 7.5e-9; bounds 5e-6 and 1e-7, far below one quantization level
        # (the scales s, ~1e-3 here), so one flipped sign or a wrong scale fails.
        tol = 1e-7
        assert measured("adam_w", np.max(np.abs(flat(params) - w2))) <= 5e-6, f"rank {r} step {t}: weights differ"
        assert measured("adam_m", np.max(np.abs(flat([opt.state[p]["exp_avg"] for p in params]) - m2))) <= tol, f"step {t}: momentum"
        assert np.array_equal(flat([opt.state[p]["exp_avg_sq"] for p in params]), v2) or t <= freeze, \
            f"rank {r} step {t}: the variance changed after freeze_step"
        if t > freeze and n > 1:
            res = opt.compressor.residuals("OneBitAdam.exp_avg")
            assert measured("adam_we", np.max(np.abs(res[0].numpy() - wres2[r]))) <= tol, f"rank {r} step {t}: worker residual"
            assert measured("adam_se", np.max(np.abs(res[1].numpy() - sres2[r]))) <= tol, f"rank {r} step {t}: server residual"
    assert_same_on_all_ranks(params)
    if n > 1:
        # wire bytes per compressed step: 2(N-1)(m/8 + 4); warm-up: the float32 ring 2(N-1)/N * 4 * total
        assert opt.bytes_sent_compressed == 16 * 2 * (n - 1) * (chunk // 8 + 4)
        assert opt.bytes_sent_warmup == freeze * ((2 * (n - 1) * 4 * total) // n)


def test_onebit_lamb_matches_numpy_model(comm):
    n, r = pycomm.size(), pycomm.rank()
    model = make_model()
    params = list(model.parameters())
    hp = dict(b1=0.9, b2=0.999, eps=1e-8, lr=0.02, wd=0.01, min_coeff=0.01, max_coeff=10.0, coeff_beta=0.9,
              factor_max=4.0, factor_min=0.5, factor_threshold=0.1)
    freeze = 5
    opt = OneBitLAMB(params, lr=hp["lr"], weight_decay=hp["wd"], freeze_step=freeze)
    total = sum(p.numel() for p in params)
    _, chunk = pycomm._C.onebit_layout(total, n)
    shapes = [tuple(p.shape) for p in params]

    def per_tensor(key, default):
        if not opt.state:
            return [np.full(s, default, np.float64) for s in shapes]
        return [opt.state[p][key].detach().double().numpy().copy() for p in params]

    for t in range(1, 21):
        local_backward(model, t)
        grads = [[g.astype(np.float64) for g in lg] for lg in
                 comm.allgather([p.grad.detach().numpy().copy() for p in params])]
        ws = [p.detach().double().numpy().copy() for p in params]
        ms, vs, vfs = per_tensor("exp_avg", 0.0), per_tensor("exp_avg_sq", 0.0), per_tensor("exp_avg_sq_fresh", 0.0)
        cfs = [float(opt.state[p]["lamb_coeff_freeze"]) if opt.state else 0.0 for p in params]
        lfs = [float(opt.state[p]["last_factor"]) if opt.state else 1.0 for p in params]
        scs = [float(opt.state[p]["scaling_coeff"]) for p in params] if opt.state and \
            "scaling_coeff" in opt.state[params[0]] else None
        res = opt.compressor.residuals("OneBitLAMB.exp_avg")
        we = res[0].numpy().copy() if res else np.zeros(total, np.float32)
        se = res[1].numpy().copy() if res else np.zeros(chunk, np.float32)
        wres, sres = gather(comm, we), gather(comm, se)
        out = onebit_lamb_step(ws, ms, vs, vfs, cfs, lfs, scs, grads, wres, sres, t, freeze, hp)
        ws2, ms2, _, vfs2, cfs2, lfs2, _, wres2, sres2, coeffs = out
        opt.step()
        # float32 step against float64 numpy from the same state (PYCOMM_TEST_MEASURE=1, 1-4 ranks):
        # weights <= 2e-8, m <= 5.1e-9, v_fresh <= 4e-10, residuals <= 9.3e-9, last factor <= 1.4e-7 and
        # trust ratios <= 1.8e-7 relative, frozen coefficient <= 3.7e-9; bounds about 10x those.
        for i, p in enumerate(params):
            assert measured("lamb_w", np.max(np.abs(p.detach().double().numpy() - ws2[i]))) <= 2e-7, f"rank {r} step {t}: weight {i}"
            assert measured("lamb_m", np.max(np.abs(opt.state[p]["exp_avg"].double().numpy() - ms2[i]))) <= 5e-8, f"step {t}: m {i}"
            assert measured("lamb_vf", np.max(np.abs(opt.state[p]["exp_avg_sq_fresh"].double().numpy() - vfs2[i]))) <= 4e-9
            assert measured("lamb_lf", abs(float(opt.state[p]["last_factor"]) - lfs2[i]) / max(1.0, lfs2[i])) <= 1.5e-6
            assert measured("lamb_cf", abs(float(opt.state[p]["lamb_coeff_freeze"]) - cfs2[i]) / max(1.0, cfs2[i])) <= 4e-8
        assert measured("lamb_coeff", float(np.max(np.abs(np.array(opt.lamb_coeffs) - coeffs) / np.abs(coeffs)))) <= 2e-6, \
            f"rank {r} step {t}: trust ratios"
        if t > freeze and n > 1:
            res = opt.compressor.residuals("OneBitLAMB.exp_avg")
            assert measured("lamb_we", np.max(np.abs(res[0].numpy() - wres2[r]))) <= 1e-7
            assert measured("lamb_se", np.max(np.abs(res[1].numpy() - sres2[r]))) <= 1e-7
    assert_same_on_all_ranks(params)


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLAMB])
def test_dead_inputs_take_no_step(cls):
    """Weights of always-zero inputs have v = 0 at the freeze. The 1-bit average spreads +-scale onto
    them (the worker residual there is non-zero at N > 1); without the rule the step would be
    lr * scale / eps. They must stay exactly at their initial values, everything stays finite, and
    the live weights keep training."""
    n, r = pycomm.size(), pycomm.rank()
    model = make_model()
    first = model[0].weight
    w0 = first.detach().clone()
    opt = cls(model.parameters(), lr=0.01, freeze_step=4)
    for t in range(40):
        local_backward(model, t)
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters()), f"rank {r}: {cls.__name__} blew up"
    v = opt.state[first]["exp_avg_sq"]
    assert torch.equal(v[:, :DEAD], torch.zeros_like(v[:, :DEAD])) and bool((v[:, DEAD:] > 0).all())
    assert torch.equal(first.detach()[:, :DEAD], w0[:, :DEAD]), f"rank {r}: dead-input weights moved"
    assert torch.equal(opt.state[first]["exp_avg"][:, :DEAD], torch.zeros_like(v[:, :DEAD]))
    assert float((first.detach()[:, DEAD:] - w0[:, DEAD:]).abs().min()) > 0, "live weights did not train"
    # the floor: positive v below 1% of the tensor's mean v is raised to it, zeros stay (numpy in float64)
    vf = opt.frozen_variance(v).double().numpy()
    vn = v.double().numpy()
    floor = 0.01 * vn.mean()
    assert np.allclose(vf, np.where(vn > 0, np.maximum(vn, floor), 0.0), rtol=1e-6, atol=0)
    tiny = torch.tensor([0.0, 1e-12, 1.0, 3.0])
    assert torch.allclose(opt.frozen_variance(tiny), torch.tensor([0.0, 0.01, 1.0, 3.0]))
    if n > 1:
        we = opt.compressor.residuals(cls._momentum_name)[0][:first.numel()].view_as(first)
        assert float(we[:, :DEAD].abs().max()) > 0, "the compressed average did not reach the dead elements"


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLAMB])
def test_resume_is_bitwise(cls):
    """Save in the compression stage (residuals non-zero), continue; a fresh optimizer loaded from the
    checkpoint continues bitwise identically."""
    model = make_model()
    opt = cls(model.parameters(), lr=0.01, weight_decay=0.01, freeze_step=3)
    for s in range(7):
        local_backward(model, s)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    if pycomm.size() > 1:
        assert opt.state_dict()["pycomm_compression"]["residuals"], "residuals missing from state_dict()"
    for s in range(7, 14):
        local_backward(model, s)
        opt.step()
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    model2 = make_model()
    model2.load_state_dict(ck["model"])
    opt2 = cls(model2.parameters(), lr=0.01, weight_decay=0.01, freeze_step=3)
    opt2.load_state_dict(ck["opt"])
    for s in range(7, 14):
        local_backward(model2, s)
        opt2.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b), f"rank {pycomm.rank()}: {cls.__name__} resume is not bitwise"


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLAMB])
def test_not_wrapped_in_distributed_optimizer(cls):
    model = make_model()
    with pytest.raises(TypeError, match=f"{cls.__name__} is the whole data-parallel step"):
        pycomm.DistributedOptimizer(cls(model.parameters()), model.named_parameters())


def test_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError, match="freeze_step must be a non-negative integer"):
        OneBitAdam(model.parameters(), freeze_step=-1)
    with pytest.raises(TypeError, match="the compressed allreduce takes float32 CPU tensors"):
        OneBitAdam(make_model().double().parameters())
    with pytest.raises(ValueError, match="variance_floor must be in"):
        OneBitAdam(model.parameters(), variance_floor=-0.1)
    with pytest.raises(ValueError, match="need 0 < min_coeff <= max_coeff"):
        OneBitLAMB(model.parameters(), min_coeff=0.0)
