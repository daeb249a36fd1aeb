"""hvd.DistributedOptimizer and the broadcast helpers against numpy float64 references."""
import numpy as np
import pytest
import torch

import pycomm.horovod as hvd


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    g = torch.Generator().manual_seed(100 + hvd.rank())
    x = torch.randn(4 + hvd.rank(), 5, generator=g, dtype=torch.float64)  # uneven local batches
    return model, x


def local_grads(model, x):
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [p.grad.clone().numpy() for p in model.parameters()]


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_step_applies_reduced_gradients(comm, op):
    model, x = model_and_data()
    ref_model, _ = model_and_data()
    grads = local_grads(ref_model, x)
    # Reference: mpi4py's float64 sum of every rank's gradients (divided by N for Average).
    reduced = [comm.allreduce(g) / (hvd.size() if op == hvd.Average else 1) for g in grads]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=op)
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()
    for p, p0, g in zip(model.parameters(), ref_model.parameters(), reduced):
        # float64 sums of N values in another order: < 1e-15 relative, measured.
        np.testing.assert_allclose(p.detach().numpy(), p0.detach().numpy() - 0.1 * g, rtol=1e-12, atol=1e-14)


def test_backward_passes_and_synchronize(comm):
    model, x = model_and_data(1)
    ref_model, _ = model_and_data(1)
    g1 = local_grads(ref_model, x[:2])
    g2 = local_grads(ref_model, x[2:])
    reduced = [comm.allreduce(a + b) / hvd.size() for a, b in zip(g1, g2)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    opt.zero_grad()
    model(x[:2]).pow(2).sum().backward()
    model(x[2:]).pow(2).sum().backward()
    opt.synchronize()
    for p, g in zip(model.parameters(), reduced):
        np.testing.assert_allclose(p.grad.numpy(), g, rtol=1e-12, atol=1e-14)  # float64, measured < 1e-15
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    with opt.skip_synchronize():
        opt.step()
    for p, p0, g in zip(model.parameters(), ref_model.parameters(), reduced):
        np.testing.assert_allclose(p.detach().numpy(), p0.detach().numpy() - 0.1 * g, rtol=1e-12, atol=1e-14)


def test_optimizer_arguments_refused_clearly():
    model, _ = model_and_data()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(sgd, model.named_parameters(), op=hvd.Adasum)
    with pytest.raises(ValueError, match="gradient_predivide_factor needs op=hvd.Average"):
        hvd.DistributedOptimizer(sgd, model.named_parameters(), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="num_groups/groups"):
        hvd.DistributedOptimizer(sgd, model.named_parameters(), num_groups=2)
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum"):
        hvd.DistributedOptimizer(sgd, model.named_parameters(), op=hvd.Max)


def test_broadcast_parameters_and_optimizer_state():
    torch.manual_seed(hvd.rank())  # different on every rank
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    every = hvd.allgather_object({k: v for k, v in model.state_dict().items()})
    for other in every:
        for k in other:
            assert torch.equal(other[k], every[0][k])
    states = hvd.allgather_object(opt.state_dict())
    assert all(s["param_groups"][0]["lr"] == 0.01 for s in states)
    for s in states:
        for key in s["state"]:
            assert torch.equal(s["state"][key]["exp_avg"], states[0]["state"][key]["exp_avg"])
