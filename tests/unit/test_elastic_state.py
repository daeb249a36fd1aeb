"""pycomm.elastic's TorchState and ElasticSampler, in one process (the kill tests: tests/test_elastic.py)."""
import pytest
import torch

from pycomm.elastic import ElasticSampler, TorchState


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def _train_step(model, optimizer):
    optimizer.zero_grad()
    model(torch.randn(7, 5)).pow(2).sum().backward()
    optimizer.step()


def test_restore_returns_model_optimizer_and_counters_to_the_commit_bit_for_bit():
    model, optimizer = _model_and_optimizer()
    state = TorchState(model, optimizer, epoch=2, batch=5)
    _train_step(model, optimizer)
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    weight = model.weight  # restore writes into the same tensors the optimizer updates
    for _ in range(3):
        _train_step(model, optimizer)
    state.epoch, state.batch = 3, 0
    assert not torch.equal(model.weight, committed[0])
    state.restore()
    assert model.weight is weight
    for p, c, m in zip(model.parameters(), committed, momentum):
        assert torch.equal(p, c)
        assert torch.equal(optimizer.state[p]["momentum_buffer"], m)
    assert (state.epoch, state.batch) == (2, 5)


def test_a_commit_is_a_copy_that_later_steps_do_not_change():
    model, optimizer = _model_and_optimizer()
    state = TorchState(model, optimizer)
    before = model.weight.detach().clone()
    _train_step(model, optimizer)
    state.restore()
    assert torch.equal(model.weight, before)


def test_reset_callbacks_run_in_order_and_unknown_attributes_raise():
    model, optimizer = _model_and_optimizer()
    state = TorchState(model, optimizer)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(1), lambda: calls.append(2)])
    state.on_reset()
    assert calls == [1, 2]
    with pytest.raises(AttributeError, match="no attribute 'epochs'"):
        state.epochs


@pytest.mark.parametrize("n,replicas", [(0, 3), (1, 3), (10, 3), (17, 4), (32, 4)])
def test_sampler_partitions_every_sample_over_the_ranks(n, replicas):
    data = list(range(n))
    shares = [list(ElasticSampler(data, seed=3, num_replicas=replicas, rank=r)) for r in range(replicas)]
    assert len({len(s) for s in shares}) == 1  # equal shares (padded)
    seen = [i for s in shares for i in s]
    assert sorted(set(seen)) == data
    assert len(seen) - len(set(seen)) == (-n) % replicas if n else len(seen) == 0


def test_sampler_after_a_shrink_skips_what_was_processed_and_repartitions_the_rest():
    data = list(range(103))
    before = [ElasticSampler(data, seed=1, num_replicas=4, rank=r) for r in range(4)]
    orders = [list(s) for s in before]
    steps, batch = 5, 3
    processed = {i for o in orders for i in o[:steps * batch]}
    for s in before:
        for b in range(steps):
            s.record_batch(b, batch)
    assert before[0].processed == steps * batch * 4
    # One rank died: three survivors carry the processed count over and re-partition.
    after = []
    for r in range(3):
        s = ElasticSampler(data, seed=1, num_replicas=3, rank=r)
        s.load_state_dict(before[0].state_dict())
        after.append(list(s))
    rest = [i for o in after for i in o]
    assert set(rest) == set(data) - processed  # nothing skipped, nothing processed twice
    assert len({len(o) for o in after}) == 1


def test_sampler_epochs_reshuffle_and_start_afresh():
    data = list(range(50))
    s = ElasticSampler(data, seed=9, num_replicas=1, rank=0)
    first = list(s)
    s.record_batch(0, 10)
    s.set_epoch(1)
    assert s.processed == 0 and len(list(s)) == 50 and list(s) != first
    s.set_epoch(0)
    assert list(s) == first
    unshuffled = ElasticSampler(data, shuffle=False, num_replicas=2, rank=1)
    assert list(unshuffled) == list(range(1, 50, 2))
