"""The parameter-server transport against a float64 numpy model of the server.

Workers act in a seeded random order of turns (pycomm.ps.TurnSchedule), so
the asynchronous run is replayable: every rank replays all workers in numpy
and compares its pulled weights and the servers' staleness histograms. Both
placements: co-located (every rank serves a shard) and dedicated (the last K
ranks only serve). Tensor sizes include 0, 1, odd and fewer elements than
servers.
"""
import numpy as np
import pytest
import torch

import pycomm
from pycomm.ps import ParameterServer, TurnSchedule, UpdateRule

from ps_ref import NpServer

SHAPES = {"a": (37, 5), "b": (1,), "c": (0,), "d": (2,), "e": (1001,)}

# float32 server vs float64 reference: a few float32 roundings per update; the same kernel in the algorithm
# replays measured up to 3.4e-7 relative (tolerance set to 1e-12, 3 ranks). 1e-6 keeps margin; a wrong
# staleness, backup or step size changes results by 1e-2 or more.
TOL = 1e-6


def placements():
    n = pycomm.size()
    out = [0]
    if n >= 2:
        out.append(1)
    if n >= 4:
        out.append(2)
    return out


def initial(seed, shapes=SHAPES):
    g = np.random.default_rng(seed)
    return {k: g.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def grad_of(w, k, turn):
    """A deterministic gradient of the pulled weights: depends on w, the worker and the turn."""
    g = np.random.default_rng(1000 * turn + k)
    return (0.5 * w + g.standard_normal(w.shape)).astype(np.float32)


def run_schedule(servers, rule_kw, order, seed=0, mode="async", shapes=SHAPES, shared=None):
    """mode: "async" (push_async, then pull_async), "blocking" (push, then pull) or "push_pull".
    shared: ParameterServer's shared_memory (None: servers of this host reach the worker's memory directly,
    False: every byte to another process goes through MPI messages)."""
    ps = ParameterServer(UpdateRule(**rule_kw), servers=servers, shared_memory=shared)
    if shared is False:
        assert ps.shared_servers == []
    if not ps.is_worker:
        ps.serve()
        return None
    W, k = ps.num_workers, ps.worker_index
    init = initial(seed, shapes)
    params = {n: torch.from_numpy(v.copy()) for n, v in init.items()}
    ps.register(params)
    ref = NpServer(W, **rule_kw)
    for n, v in init.items():
        ref.init(n, v)
    local = [{n: v.astype(np.float64) for n, v in init.items()} for _ in range(W)]
    for j in range(W):  # register() pulls on every worker
        for n in shapes:
            ref.pull(j, n)
    sched = TurnSchedule(ps, order)
    for turn, who in enumerate(order):
        grads = {n: grad_of(local[who][n].astype(np.float32), who, turn) for n in shapes}
        for n in shapes:
            ref.push(who, n, grads[n])
            local[who][n] = ref.pull(who, n)
        if who != k:
            continue
        with sched.turn():
            gt = {n: torch.from_numpy(grads[n]) for n in shapes}
            if mode == "push_pull":
                hs = [ps.push_pull_async(n, gt[n], params[n]) for n in shapes]
                for h in hs:
                    h.wait()
            elif mode == "async":
                hs = [ps.push_async(n, gt[n]) for n in shapes]
                hs += [ps.pull_async(n, params[n]) for n in shapes]
                for h in hs:
                    h.wait()
            else:
                for n in shapes:
                    ps.push(n, gt[n])
                for n in shapes:
                    ps.pull(n, params[n])
        for n in shapes:
            scale = 1 + np.abs(local[k][n]).max(initial=0)
            err = np.abs(params[n].numpy() - local[k][n]).max(initial=0) / scale
            assert err < TOL, f"rank {pycomm.rank()} turn {turn} '{n}' {rule_kw}: off the reference by {err:.3g}"
    ps.barrier()
    st = ps.stats()
    # Each (push, shard) counts once: a tensor of n elements lives on min(n, K) servers.
    shards = sum(min(int(np.prod(s)), ps.num_servers) for s in shapes.values())
    per_tensor = ref.hist // len(shapes)
    assert np.array_equal(np.asarray(st["histogram"]), per_tensor * shards), \
        f"staleness histogram {st['histogram']} != reference {(per_tensor * shards).tolist()}"
    if order:
        assert st["max_staleness"] == int(np.nonzero(per_tensor.sum(0))[0].max())
    ps.shutdown()
    return st


def orders(W, turns, seed):
    return np.random.default_rng(seed).integers(0, W, size=turns).tolist()


@pytest.mark.parametrize("shared", [None, False])
@pytest.mark.parametrize("servers", [0, 1, 2])
@pytest.mark.parametrize("rule", [dict(lr=0.05), dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
                                  dict(lr=0.05, compensation="constant", dc_lambda=0.5),
                                  dict(lr=0.05, momentum=0.5, compensation="adaptive", dc_lambda=2.0),
                                  dict(adadelay=True, adadelay_L=20.0, adadelay_c=0.5)])
def test_schedule_matches_numpy(servers, rule, shared):
    if servers not in placements():
        pytest.skip(f"{servers} dedicated servers need more ranks")
    n = pycomm.size()
    W = n - servers
    mode = {0: "push_pull", 1: "blocking", 2: "async"}[servers]
    run_schedule(servers, rule, orders(W, 6 * W + 3, seed=servers + 7), mode=mode, shared=shared)


# Shards of several chunks (pycomm.ps sends push data in 1 MiB chunks and updates each as it lands, in a
# receive window of 4 chunk buffers; push_pull updates and copies the local shard chunk by chunk): per
# server 5 full chunks and a remainder, so the window wraps, the tensor's length not a multiple of the servers.
CHUNK = 1 << 18  # floats per chunk (protocol.h kChunkBytes / 4)


@pytest.mark.parametrize("shared", [None, False])
@pytest.mark.parametrize("mode", ["async", "push_pull"])
@pytest.mark.parametrize("servers", [0, 1])
def test_multi_chunk_shards_match_numpy(servers, mode, shared):
    if servers not in placements():
        pytest.skip(f"{servers} dedicated servers need more ranks")
    K = pycomm.size() if servers == 0 else servers
    shapes = {"big": (K * (5 * CHUNK + 4099) + 3,), "b": (5,)}
    W = pycomm.size() - servers
    rule = dict(lr=0.05, momentum=0.5, compensation="adaptive", dc_lambda=2.0)  # offsets of v, ms and w_bak
    run_schedule(servers, rule, orders(W, 2 * W + 1, seed=servers + 3), shapes=shapes, mode=mode, shared=shared)


@pytest.mark.parametrize("shared", [None, False])
@pytest.mark.parametrize("servers", [0, 1])
def test_push_pull_replies_are_whole_updates_while_others_push(servers, shared):
    """Every worker push_pulls at once, with no schedule, so pushes of other workers land on a shard while
    a reply of it is read (copy-on-write of a shard still being sent, chunked pushes updated as they land).
    All gradients are equal, so the state after k updates is known whatever the order: with momentum,
    v_k = m v_(k-1) + 1 and w_k = w_(k-1) - lr v_k on every element. Each reply must be one whole state w_k
    of its shard (no chunk from before or after another worker's update), k must grow with every call of
    a worker, and after all calls every shard is w_(W * rounds): no update lost or applied twice."""
    if servers not in placements():
        pytest.skip(f"{servers} dedicated servers need more ranks")
    lr, m = 0.5, 0.9
    ps = ParameterServer(UpdateRule(lr=lr, momentum=m), servers=servers, shared_memory=shared)
    if not ps.is_worker:
        ps.serve()
        return
    K, W, rounds = ps.num_servers, ps.num_workers, 6
    ref, w, v = [0.0], 0.0, 0.0
    for _ in range(W * rounds):
        v = m * v + 1.0
        w -= lr * v
        ref.append(w)
    ref = np.asarray(ref)
    n = K * (3 * CHUNK + 17) + 5  # 3 full chunks and a remainder per server
    bounds = [(j * (n // K) + min(j, n % K), (j + 1) * (n // K) + min(j + 1, n % K)) for j in range(K)]
    ps.register({"w": torch.zeros(n)})
    g, out = torch.ones(n), torch.empty(n)
    last = [0] * K
    for _ in range(rounds):
        ps.push_pull("w", g, out)
        o = out.numpy()
        for j, (b, e) in enumerate(bounds):
            part = o[b:e]
            # every element of a shard takes the same float32 operations, so a whole state is uniform
            assert part.min() == part.max(), f"rank {pycomm.rank()}: shard {j} torn: {np.unique(part)[:6]}"
            # float32 server against the float64 recursion: measured at most 1.6e-7 relative (2 and 4 ranks, 24 updates)
            k = int(np.argmin(np.abs(ref - part[0])))
            assert abs(ref[k] - part[0]) <= 2e-6 * abs(ref[k]), (j, part[0], ref[k])
            assert k > last[j], f"shard {j}: state {k} after state {last[j]}"
            last[j] = k
    ps.barrier()
    ps.pull("w", out)
    assert np.allclose(out.numpy(), ref[-1], rtol=2e-6, atol=0), (np.unique(out.numpy())[:6], ref[-1])
    ps.shutdown()


def test_shared_memory_reaches_every_server_of_the_host():
    """On one host (every rank here), a worker's requests to every other server's process go through shared
    memory: each server read the worker's probe token with process_vm_readv."""
    ps = ParameterServer(UpdateRule(lr=0.1), servers=1 if pycomm.size() >= 2 else 0)
    if ps.is_worker:
        others = [r for r in ps.server_ranks if r != pycomm.rank()]
        assert ps.shared_memory_error is None, ps.shared_memory_error
        assert ps.shared_servers == others
    else:
        ps.serve()
    ps.shutdown()


def test_shared_memory_refused_warns_and_falls_back_to_messages(monkeypatch):
    """Where the kernel refuses (simulated: every probe fails with EPERM), a worker warns once, names the
    servers, and its data goes through MPI messages with the same results; with shared_memory=True every
    rank raises instead of starting."""
    from pycomm import _C

    monkeypatch.setattr(_C, "ps_memory_probe", lambda pid, address, n: (1, b"", "Operation not permitted"))
    n = pycomm.size()
    if n == 1:
        ps = ParameterServer(UpdateRule(lr=0.1))  # no other process: nothing to probe, nothing to warn about
        assert ps.shared_servers == [] and ps.shared_memory_error is None
        ps.shutdown()
        return
    with pytest.warns(RuntimeWarning, match=r"cannot reach this worker's memory \(process_vm_readv: server rank "):
        ps = ParameterServer(UpdateRule(lr=0.5))
    assert ps.shared_servers == [] and "Operation not permitted" in ps.shared_memory_error
    w = torch.zeros(1000)
    ps.register({"w": w})
    ps.push_pull("w", torch.ones(1000), w)
    ps.barrier()
    ps.pull("w", w)
    assert np.array_equal(w.numpy(), np.full(1000, -0.5 * n, np.float32))
    ps.shutdown()
    with pytest.raises(pycomm.CommError, match=r"shared_memory=True, but servers cannot reach .* worker rank"):
        ParameterServer(UpdateRule(lr=0.5), shared_memory=True)


def test_blocking_and_round_robin_staleness():
    """Round-robin turns: after the first round every gradient is exactly W-1 updates old."""
    st = run_schedule(0, dict(lr=0.01), list(range(pycomm.size())) * 3, mode="blocking")
    W = pycomm.size()
    assert st["max_staleness"] == W - 1


def test_bad_input_and_servers_keep_serving():
    ps = ParameterServer(UpdateRule(lr=0.1), servers=1 if pycomm.size() >= 2 else 0)
    if not ps.is_worker:
        ps.serve()
        return
    r = pycomm.rank()
    w = torch.arange(10, dtype=torch.float32)
    ps.register({"w": w})
    with pytest.raises(ValueError, match=rf"push\('w'\) on rank {r}: shape \(9,\) differs from the registered \(10,\)"):
        ps.push("w", torch.zeros(9))
    with pytest.raises(TypeError, match=rf"push\('w'\) on rank {r}: dtype torch.float64; .*float32"):
        ps.push("w", torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"pull\('nope'\) on rank {r}: unknown name; declared: w"):
        ps.pull("nope", torch.zeros(3))
    with pytest.raises(ValueError, match="not contiguous"):
        ps.push("w", torch.zeros(20)[::2])
    ps.declare("later", (4,))
    with pytest.raises(pycomm.CommError, match=rf"pull\('later'\) on rank {r}: no worker has initialized it yet"):
        ps.pull("later", torch.zeros(4))
    with pytest.raises(ValueError, match=r"push\('later'\) .* has no value on the servers yet"):
        ps.push("later", torch.zeros(4))
    with pytest.raises(ValueError, match=rf"push_pull\('w'\) on rank {r}: shape \(9,\) differs"):
        ps.push_pull("w", torch.zeros(10), torch.zeros(9))
    with pytest.raises(ValueError, match=r"push_pull\('later'\) .* has no value on the servers yet"):
        ps.push_pull("later", torch.zeros(4), torch.zeros(4))
    shared = torch.zeros(10)
    with pytest.raises(ValueError, match=r"push_pull\('w'\) .*grad and out share memory"):
        ps.push_pull("w", shared, shared)
    # The servers still serve: a good push lands.
    ps.barrier()
    ps.push("w", torch.ones(10))
    ps.barrier()
    out = torch.zeros(10)
    ps.pull("w", out)
    expect = np.arange(10) - 0.1 * ps.num_workers
    # W float32 roundings of values below 16 (ulp 9.5e-7): measured error 3.1e-7 at 4 ranks
    assert np.allclose(out.numpy(), expect, rtol=0, atol=4e-6), out
    ps.shutdown()
    with pytest.raises(pycomm.CommError, match="was shut down"):
        ps.push("w", torch.ones(10))


def test_uneven_workers_finish_without_hanging():
    """Worker k pushes 3k+1 times and shuts down at once; the last worker, whose co-located servers
    include those of finished workers, still gets every push applied and served."""
    ps = ParameterServer(UpdateRule(lr=1.0), servers=1 if pycomm.size() >= 3 else 0)
    if not ps.is_worker:
        ps.serve()
        return
    W, k = ps.num_workers, ps.worker_index
    w = torch.zeros(33)
    ps.register({"w": w})
    for _ in range(3 * k + 1):
        ps.push_async("w", torch.ones(33)).wait()
    last = W - 1
    if k != last:
        ps.flush()  # this worker's pushes are applied
        ps.worker_comm.send(k, dest=last, tag=5)
        ps.shutdown()  # co-located: serves the others until they are done too
        return
    for _ in range(W - 1):
        ps.worker_comm.recv(tag=5)
    ps.flush()
    ps.pull("w", w)
    expect = -float(sum(3 * j + 1 for j in range(W)))
    assert torch.all(w == expect), f"{w[0].item()} != {expect}: pushes lost"
    assert sum(ps.stats()["pushes"]) == sum(3 * j + 1 for j in range(W)) * min(33, ps.num_servers)
    ps.shutdown()


def test_ssp_bound_zero_is_bsp():
    """s = 0: a worker's pull at clock c sees exactly the c rounds of every worker's gradients (BSP)."""
    ps = ParameterServer(UpdateRule(lr=0.1), servers=0, staleness_bound=0)
    W, k = ps.num_workers, ps.worker_index
    w = torch.zeros(7)
    ps.register({"w": w})
    for c in range(1, 6):
        g = torch.full((7,), float(k + 1)) * c
        ps.push("w", g)
        ps.clock_pull({"w": w})
        # BSP: w_c = -0.1 * sum_{c'<=c} sum_k (k+1) c'; float32 sums of <= 40 terms of 0.1 * small integers:
        # rounding error a few ulps, below 1e-6 relative
        expect = -0.1 * sum(range(1, W + 1)) * c * (c + 1) / 2
        assert np.allclose(w.numpy(), expect, rtol=1e-6, atol=0), f"clock {c}: {w[0].item()} != {expect}"
    ps.shutdown()


def test_ssp_clock_bounds_the_lead():
    """s = 2: no worker passes clock c before every worker has reached c - 2; worker 0 is slow."""
    import time
    ps = ParameterServer(UpdateRule(lr=0.1), servers=0, staleness_bound=2)
    W, k = ps.num_workers, ps.worker_index
    w = torch.zeros(5)
    ps.register({"w": w})
    for c in range(1, 8):
        if k == 0:
            time.sleep(0.02)
        ps.push("w", torch.ones(5))
        ps.clock_pull({"w": w})
        # w counts the pushes the servers had applied when this clock was granted
        applied = int(round(-w[0].item() / 0.1))
        # every worker had reached clock c - 2 (and pushed before it ticked), this one clock c
        least = c + (W - 1) * max(c - 2, 0)
        assert applied >= least, f"worker {k} passed clock {c} after {applied} pushes; SSP needs >= {least}"
    ps.shutdown()


def test_state_dict_round_trip():
    ps = ParameterServer(UpdateRule(lr=0.1, momentum=0.9, compensation="adaptive"), servers=0)
    w = torch.randn(19, generator=torch.Generator().manual_seed(3))
    ps.register({"w": w})
    ps.push("w", torch.ones(19))
    state = ps.state_dict()
    saved = w.clone()
    ps.barrier()
    ps.pull("w", saved)
    stats = ps.stats()
    ps.barrier()  # every worker read the stats before anyone pushes again
    ps.push("w", torch.ones(19))  # changes weights, momentum, mean square, versions
    ps.barrier()
    ps.load_state_dict(state)
    ps.pull("w", w)
    assert torch.equal(w, saved)
    assert ps.stats()["histogram"] == stats["histogram"]
    ps.barrier()
    # The restored momentum, mean square and backups give the same next update as the first time
    # (one worker pushes: with several, the order of their pushes would change the result).
    if ps.worker_index == 0:
        ps.push("w", torch.ones(19))
    ps.barrier()
    again = torch.empty(19)
    ps.pull("w", again)
    ps.barrier()
    ps.load_state_dict(state)
    ps.pull("w", w)  # as above: the pull sets this worker's backup and version
    ps.barrier()
    if ps.worker_index == 0:
        ps.push("w", torch.ones(19))
    ps.barrier()
    ps.pull("w", w)
    assert torch.equal(w, again)
    ps.shutdown()


def test_silent_worker_is_named(capfd):
    """A worker that stops talking while another has finished is reported by the servers, by index and rank."""
    import time
    if pycomm.size() < 2:
        pytest.skip("needs two workers")
    ps = ParameterServer(UpdateRule(lr=0.1), servers=0, stall_report_s=1.0)
    w = torch.zeros(3)
    ps.register({"w": w})
    last = ps.num_workers - 1
    if ps.worker_index == last:
        time.sleep(3.0)  # silent; worker 0 is already done
    ps.shutdown()
    if ps.worker_index == 0:
        err = capfd.readouterr().err
        assert f"worker {last} (rank {last}) has sent nothing for" in err, err
        assert "it may have died or stalled" in err


def test_a_dead_worker_makes_shutdown_raise(monkeypatch, capfd):
    """A worker whose process is gone is named at once, the others go on, and the servers' shutdown raises on
    every rank: ending as if all had finished would read as a complete run. The last worker stands in for a dead
    one by reporting the pid of a child that has already exited (a real kill ends the job through the launcher:
    tests/test_faults.py)."""
    import os
    import subprocess
    import time
    if pycomm.size() < 2:
        pytest.skip("needs two workers")
    last = pycomm.size() - 1
    pid = 0
    if pycomm.rank() == last:
        child = subprocess.Popen(["true"])
        child.wait()  # reaped: /proc/<pid> is gone
        pid = child.pid
        monkeypatch.setattr(os, "getpid", lambda: pid)
    ps = ParameterServer(UpdateRule(lr=0.1), servers=0, shared_memory=False)
    monkeypatch.undo()
    pid = pycomm.broadcast_object(pid, root=last)
    w = torch.zeros(5)
    ps.register({"w": w})
    # Every rank serves a shard, and every server names the dead worker within its 10 ms liveness check.
    err, t0 = "", time.time()
    while "has died" not in err and time.time() - t0 < 60:
        time.sleep(0.01)
        err += capfd.readouterr().err
    assert f"server on rank {pycomm.rank()}: worker {last} (rank {last}, pid {pid}) has died" in err, err
    ps.push("w", torch.ones(5))  # and goes on serving the others
    ps.pull("w", w)
    if ps.worker_index == last:
        # Tell every server this worker is done while they all still run (after the others' shutdown, a server
        # may already have ended); its shutdown below then only joins its server.
        ps._say_done()
    ps.comm.Barrier()
    with pytest.raises(pycomm.CommError, match=rf"worker {last} \(rank {last}, pid \d+\) died before shutting"):
        ps.shutdown()
