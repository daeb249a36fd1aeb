"""DDP, ZeroRedundancyOptimizer and FSDP over backend="pycomm" train exactly like over gloo."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import pycomm.distributed  # noqa: F401

# Both runs start from the same parameters and see the same data; only the reduction order of the
# float32 gradient sums differs (pycomm's ring/shm/mpi vs gloo's), so parameters differ by a few
# float32 ulps. Measured after 10 steps (the train_* functions below, under pycomm-run):
# max |param diff| 0 at 2 ranks and 1.5e-8 at 4 ranks, max |loss diff| 2.4e-7; ZeRO and FSDP at
# 2 ranks: 0. 1e-5 leaves a wide margin while still catching a missing or wrong reduction (which
# moves parameters by ~1e-2 per step).
ATOL = 1e-5


@pytest.fixture(scope="module")
def gloo():
    if not dist.is_initialized():
        dist.init_process_group("pycomm")
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def batches(steps=10):
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    return [(torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(steps)]


def train_ddp(group, steps=10):
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = DDP(model(), process_group=group, bucket_cap_mb=0.01)  # several buckets: more allreduces in flight
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in m.module.parameters()], losses


def test_ddp_matches_gloo(gloo):
    p_pycomm, l_pycomm = train_ddp(None)  # default group: pycomm
    p_gloo, l_gloo = train_ddp(gloo)
    for a, b in zip(p_pycomm, p_gloo):
        assert torch.allclose(a, b, rtol=0, atol=ATOL), (a - b).abs().max()
    assert l_pycomm == pytest.approx(l_gloo, abs=ATOL)
    # every rank holds the same parameters
    flat = torch.cat([p.reshape(-1) for p in p_pycomm])
    first = flat.clone()
    dist.broadcast(first, src=0)
    assert torch.equal(flat, first)


def train_zero(group, steps=5):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = DDP(model(1), process_group=group)
    opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam, lr=0.01, process_group=group)
    losses = []
    for x, y in batches(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_zero_redundancy_optimizer_matches_gloo(gloo):
    if dist.get_world_size() != 2:
        pytest.skip("ZeroRedundancyOptimizer is checked at 2 ranks")
    assert train_zero(None) == pytest.approx(train_zero(gloo), abs=ATOL)


def train_fsdp(group, steps=5):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    m = FSDP(model(2), process_group=group, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for x, y in batches(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_fsdp_matches_gloo(gloo):
    if dist.get_world_size() != 2:
        pytest.skip("FSDP is checked at 2 ranks")
    assert train_fsdp(None) == pytest.approx(train_fsdp(gloo), abs=ATOL)
