"""pycomm.join (ranks with different numbers of batches, Horovod's hvd.join semantics), the timeline
and the stage clock (bench/allreduce.py --stages).

For join, each rank recomputes every rank's data (refdata.rank_data), so the float64
references below are independent of pycomm: a reduction over the ranks that
have not joined yet, an average divided by their number.
"""
import json

import numpy as np
import pytest
import torch

import pycomm
from refdata import rank_data, tolerance


def batches_of(r: int) -> int:
    """Batches rank r has: 1, 4, 3, 2 for ranks 0..3 (uneven, rank 1 joins last)."""
    return 1 + (3 * r) % 4


def expected_last(size: int) -> int:
    return max(range(size), key=lambda r: (batches_of(r), r))


SPECS = [  # (dtype, op, count): odd sizes, sizes not divisible by the world size
    (torch.float32, "sum", 1001), (torch.float64, "avg", 77), (torch.float32, "avg", 4099),
    (torch.float16, "avg", 333), (torch.int32, "min", 65), (torch.int64, "max", 9), (torch.float32, "max", 130),
    (torch.float64, "min", 3), (torch.float32, "sum", 0),
]


def reduce_ref(op, xs):
    stack = np.stack([x.double().numpy() for x in xs])
    return {"sum": stack.sum(0), "avg": stack.mean(0), "min": stack.min(0), "max": stack.max(0)}[op]


def check(got, op, dtype, contributors, count, seed, what):
    xs = [rank_data(r, count, dtype, seed) for r in contributors]
    ref = reduce_ref(op, xs)
    g = got.double().numpy().reshape(-1)
    if op in ("min", "max") or dtype in (torch.int32, torch.int64):
        assert np.array_equal(g, ref), f"{what}: got {g[:4]} expected {ref[:4]}"
        return
    k = len(contributors)
    # refdata.tolerance: 2*k*eps of the k-term sum relative to sum|x|, plus one rounding of the result
    # (fp16 avg: the 1/k pre-scaling is one more rounding per term, covered by the factor 2).
    mag = np.stack([np.abs(x.double().numpy()) for x in xs]).sum(0) / (k if op == "avg" else 1)
    bound = tolerance(dtype, k) * mag + np.abs(ref) * tolerance(dtype, 1)
    bad = np.flatnonzero(np.abs(g - ref) > bound)
    assert bad.size == 0, f"{what}: {bad.size} of {count} wrong; first {g[bad[0]]!r} vs {ref[bad[0]]!r}"


def test_uneven_batches_allreduce_then_join():
    rank, size = pycomm.rank(), pycomm.size()
    mine = batches_of(rank)
    for b in range(mine):
        contributors = [r for r in range(size) if batches_of(r) > b]
        # blocking calls, one per spec
        for i, (dt, op, n) in enumerate(SPECS):
            seed = 1000 * b + i
            x = rank_data(rank, n, dt, seed)
            out = pycomm.allreduce(x.clone(), op=op, name=f"b{b}.t{i}")
            check(out, op, dt, contributors, n, seed, f"batch {b} tensor {i} {dt} {op} on rank {rank}")
        # a fused batch: many small async allreduces queued together
        before = pycomm.stats()
        xs = [rank_data(rank, 17 + 5 * j, torch.float32, 500 + 100 * b + j) for j in range(12)]
        hs = [pycomm.allreduce_async(x, op="avg", name=f"b{b}.f{j}") for j, x in enumerate(xs)]
        for j, h in enumerate(hs):
            check(h.wait(), "avg", torch.float32, contributors, 17 + 5 * j, 500 + 100 * b + j, f"fused {b}.{j}")
        assert pycomm.stats()["fused_tensors"] > before["fused_tensors"], "the async batch was not fused"
        # broadcast from a rank that has not joined, allgather (joined ranks give no rows), barrier
        root = contributors[-1]
        t = rank_data(root, 41, torch.float64, 7000 + b) if rank == root else torch.zeros(41, dtype=torch.float64)
        pycomm.broadcast(t, root=root, name=f"b{b}.bcast")
        assert torch.equal(t, rank_data(root, 41, torch.float64, 7000 + b))
        g = pycomm.allgather(torch.full((2, 3), float(rank)), name=f"b{b}.gather")
        assert g[:, 0].tolist() == [float(r) for r in contributors for _ in range(2)]
        pycomm.barrier()
    last = pycomm.join()
    assert last == expected_last(size), (last, expected_last(size))
    # the job goes on normally afterwards: every rank contributes again
    x = rank_data(rank, 33, torch.float64, 9)
    check(pycomm.allreduce(x, op="avg", name="after"), "avg", torch.float64, list(range(size)), 33, 9, "after join")


def test_every_rank_joins_at_once_twice():
    size = pycomm.size()
    assert pycomm.join() == size - 1  # all join in one round: the highest rank counts as last
    assert pycomm.join() == size - 1


def test_identity_and_avg_over_contributors_with_rank0_joined():
    rank, size = pycomm.rank(), pycomm.size()
    if rank == 0:  # the coordinator itself joins first
        assert pycomm.join() == size - 1
        return
    # All values negative (max) or positive (min): a joined rank contributing 0 would show.
    neg = -torch.arange(1, 8, dtype=torch.float32) - rank
    assert torch.equal(pycomm.allreduce(neg.clone(), op="max", name="max"), -torch.arange(1, 8.0) - 1)
    pos = torch.arange(1, 8, dtype=torch.int64) + rank
    assert torch.equal(pycomm.allreduce(pos.clone(), op="min", name="min"), torch.arange(1, 8) + 1)
    out = pycomm.allreduce(torch.full((5,), float(rank)), op="avg", name="avg")
    assert torch.equal(out, torch.full((5,), sum(range(1, size)) / (size - 1)))  # exact: small integers / k
    assert pycomm.join() == size - 1


def test_unanswerable_operation_is_an_error_on_every_rank():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs a second rank to join")
    if rank == size - 1:
        with pytest.raises(pycomm.CommError) as e:
            pycomm.join()
    else:
        with pytest.raises(pycomm.CommError) as e:
            pycomm.reduce_scatter(torch.ones(size * 3), name="rs")
    msg = str(e.value)
    assert f"rank {size - 1} has joined (pycomm.join()) and cannot take part in reduce_scatter 'rs'" in msg, msg
    assert "a joined rank answers allreduce, broadcast, allgather and barrier only" in msg, msg
    # the broadcast root has joined
    if rank == size - 1:
        with pytest.raises(pycomm.CommError) as e:
            pycomm.join()
    else:
        with pytest.raises(pycomm.CommError) as e:
            pycomm.broadcast(torch.ones(4), root=size - 1, name="from_joined")
    assert f"its root, rank {size - 1}, has joined and has nothing to send" in str(e.value), str(e.value)
    # a compressed allreduce (its scheme runs on every rank) cannot be answered either
    if rank == size - 1:
        with pytest.raises(pycomm.CommError) as e:
            pycomm.join()
    else:
        with pytest.raises(pycomm.CommError) as e:
            pycomm.allreduce(torch.ones(64), op="avg", compression="fp16", name="comp")
    assert "cannot take part in allreduce 'fp16:comp'" in str(e.value), str(e.value)
    assert "a joined rank cannot answer a compressed allreduce" in str(e.value), str(e.value)
    # nothing stays joined after the errors
    out = pycomm.allreduce(torch.ones(3), op="sum", name="clean")
    assert torch.equal(out, torch.full((3,), float(size)))


def test_disagreement_among_ranks_still_running_is_reported():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 3:
        pytest.skip("needs two ranks still running and one joined")
    if rank == 0:
        with pytest.raises(pycomm.CommError) as e:
            pycomm.join()
    else:
        n = 10 if rank == 1 else 11
        with pytest.raises(pycomm.CommError) as e:
            pycomm.allreduce(torch.ones(n), name="mismatch")
    assert "ranks disagree on the call" in str(e.value) and "rank 0 has joined" in str(e.value), str(e.value)


def _batch(r, b):
    x = rank_data(r, 4 * 5, torch.float64, 8000 + 10 * b).view(4, 5) / 100
    y = rank_data(r, 4 * 3, torch.float64, 9000 + 10 * b).view(4, 3) / 100
    return x, y


def _reference_model(size):
    """Synchronous SGD with momentum where step b averages the gradients of the ranks that have batch b."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for b in range(max(batches_of(r) for r in range(size))):
        grads = []
        for r in [r for r in range(size) if batches_of(r) > b]:
            model.zero_grad()
            x, y = _batch(r, b)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / len(grads)
        opt.step()
    return model


def _train_uneven(make_opt, finish):
    rank, size = pycomm.rank(), pycomm.size()
    if size == 1:  # one rank has nothing uneven; saves torch.optim's first-use import (seconds) in CI
        pytest.skip("needs ranks with different numbers of batches")
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    opt = make_opt(model)
    for b in range(batches_of(rank)):
        opt.zero_grad()
        x, y = _batch(rank, b)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert finish(model, opt) == expected_last(size)
    ref = _reference_model(size)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # float64 averages of <= 4 gradients, 4 steps: differences from summation order only (~1e-16 measured)
        assert torch.allclose(p.detach(), q.detach(), rtol=0, atol=1e-12), (name, p, q)


def test_distributed_optimizer_uneven_batches():
    _train_uneven(
        lambda m: pycomm.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                              named_parameters=m.named_parameters()),
        lambda m, opt: opt.join())


def test_horovod_distributed_optimizer_uneven_batches():
    import pycomm.horovod as hvd

    def finish(model, opt):
        last = hvd.join()
        hvd.broadcast_parameters(model.state_dict(), root_rank=last)
        hvd.broadcast_optimizer_state(opt, root_rank=last)
        return last

    _train_uneven(
        lambda m: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=m.named_parameters()),
        finish)


# ---------------------------------------------------------------- timeline

def _lanes(events):
    """Check B/E nesting per lane (file order is each lane's logical order); return per-lane records."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    stacks, ranges = {}, []
    for e in events:
        if e.get("ph") == "B":
            stacks.setdefault(e["tid"], []).append(e)
        elif e.get("ph") == "E":
            st = stacks.get(e["tid"])
            assert st and st[-1]["name"] == e["name"], f"E {e['name']} does not close the innermost range {st and st[-1]}"
            b = st.pop()
            assert e["ts"] >= b["ts"], (b, e)
            ranges.append({"lane": names.get(e["tid"]), "name": e["name"], "depth": len(st),
                           "parent": st[-1]["name"] if st else None, "args": e.get("args", {}), "b": b["ts"],
                           "e": e["ts"]})
    assert all(not st for st in stacks.values()), "ranges left open after stop_timeline()"
    return names, ranges


def test_timeline_mid_run_phases_nest_and_fusion_listed(tmp_path):
    rank, size = pycomm.rank(), pycomm.size()
    pycomm.allreduce(torch.ones(10), name="before_timeline")  # the timeline starts mid-run
    path = pycomm.start_timeline(str(tmp_path / "trace.json"))
    assert path == str(tmp_path / f"trace.rank{rank}.json") and pycomm.timeline_path() == path
    with pytest.raises(pycomm.CommError, match="already writing"):
        pycomm.start_timeline(str(tmp_path / "other.json"))
    pycomm.allreduce(rank_data(rank, 3000, torch.float32, 1), name="tl.single", algorithm="ring")
    xs = [rank_data(rank, 100 + j, torch.float32, 2 + j) for j in range(6)]
    hs = [pycomm.allreduce_async(x, name=f"tl.fused{j}", algorithm="ring") for j, x in enumerate(xs)]
    for h in hs:
        h.wait()
    pycomm.broadcast(torch.ones(5), root=0, name="tl.bcast")
    if rank != size - 1:  # the last rank joins first and answers this allreduce
        pycomm.allreduce(torch.ones(7), name="tl.while_joined", algorithm="ring")
    assert pycomm.join() == max(size - 2, 0)
    pycomm.stop_timeline()
    pycomm.stop_timeline()  # a second stop does nothing
    assert pycomm.timeline_path() is None
    pycomm.allreduce(torch.ones(10), name="after_timeline")

    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    assert all(e["pid"] == rank for e in events)
    names, ranges = _lanes(events)
    assert "before_timeline" not in names.values() and "after_timeline" not in names.values()
    assert {"tl.single", "tl.bcast"} <= set(names.values())
    single = [r for r in ranges if r["lane"] == "tl.single"]
    top = [r for r in single if r["depth"] == 0]
    assert [r["name"] for r in top] == ["ALLREDUCE"], top
    assert any(r["name"] == "NEGOTIATE" and r["parent"] == "ALLREDUCE" for r in single)
    if size > 1:  # one rank reduces nothing: no algorithm runs
        assert any(r["name"] == "RING_ALLREDUCE" and r["parent"] == "ALLREDUCE" for r in single), single
        assert any(r["name"] == "REDUCE_SCATTER" and r["parent"] == "RING_ALLREDUCE" for r in single), single
        assert any(r["name"] == "ALLGATHER" and r["parent"] == "RING_ALLREDUCE" for r in single), single
    queued = [e for e in events if e.get("ph") == "X" and e["name"] == "QUEUED"]
    assert queued and all(e["dur"] >= 0 for e in queued)
    assert sum(1 for e in events if e.get("ph") == "i" and e["name"] == "DONE") >= 8
    # The fused batch: its ALLREDUCE end event lists the tensors fused together, on every tensor's lane.
    fused = [r for r in ranges if r["name"] == "ALLREDUCE" and r["args"].get("fused", 1) > 1]
    assert fused, "no fused batch in the timeline"
    for r in fused:
        assert r["lane"] in r["args"]["tensors"] and len(r["args"]["tensors"]) == r["args"]["fused"]
        assert all(t.startswith("tl.fused") for t in r["args"]["tensors"])
    lanes_in = [r for r in ranges if r["lane"] == fused[0]["lane"]]
    assert any(r["name"] == "PACK" for r in lanes_in) and any(r["name"] == "UNPACK" for r in lanes_in), lanes_in
    assert [r["name"] for r in ranges if r["lane"] == "tl.bcast" and r["depth"] == 0] == ["BROADCAST"]
    joins = [r for r in ranges if r["lane"] == "join"]
    assert [r["name"] for r in joins if r["depth"] == 0] == ["JOIN"], joins
    if size > 1 and rank == size - 1:  # the joined rank's answer runs the others' ring inside ANSWER
        assert any(r["name"] == "ANSWER" and r["parent"] == "JOIN" for r in joins), joins
        assert any(r["name"] == "RING_ALLREDUCE" and r["parent"] == "ANSWER" for r in joins), joins


def test_timeline_phases_of_shm_and_compressed(tmp_path):
    rank, size = pycomm.rank(), pycomm.size()
    one_node = pycomm.topology().num_nodes == 1
    path = pycomm.start_timeline(str(tmp_path / "phases.json"))
    try:
        if one_node:
            # 80 KB: the three-fence form; 4 KB: the one-fence form (up to 32 KiB)
            pycomm.allreduce(rank_data(rank, 20000, torch.float32, 3), name="tl.shm", algorithm="shm")
            pycomm.allreduce(rank_data(rank, 1000, torch.float32, 3), name="tl.shm_small", algorithm="shm")
        pycomm.allreduce(torch.ones(5000), name="tl.fp16", compression="fp16")
        pycomm.allreduce(torch.ones(5000), name="tl.onebit", compression="onebit")
    finally:
        pycomm.stop_timeline()
    with open(path) as f:
        _, ranges = _lanes(json.load(f)["traceEvents"])
    seen = {r["name"] for r in ranges}
    if size > 1 and one_node:
        assert {"LOCAL_REDUCE_SCATTER", "LOCAL_ALLGATHER"} <= {r["name"] for r in ranges if r["lane"] == "tl.shm"}
        assert "LOCAL_ALLREDUCE" in {r["name"] for r in ranges if r["lane"] == "tl.shm_small"}
    # fp16: cast, ring of the half buffer, cast back; onebit: the two-phase scheme's five steps
    assert {"COMPRESS", "RING", "DECOMPRESS", "ALLTOALL", "SERVER_REDUCE", "ALLGATHER"} <= seen, seen


def part_begin(count, parts, i):
    base, rem = divmod(count, parts)
    return i * base + min(i, rem)


def part_size(count, parts, i):
    return part_begin(count, parts, i + 1) - part_begin(count, parts, i)


def stage_totals(fn):
    pycomm._C.stage_clock_take()
    pycomm._C.stage_clock_run(True)
    try:
        fn()
    finally:
        pycomm._C.stage_clock_run(False)
    return pycomm._C.stage_clock_take()


def expect_stages(totals, nbytes, marks, what):
    """totals: {stage: (seconds, bytes, marks)}; nbytes and marks: the expected ones per stage (absent: 0)."""
    for stage, (seconds, got_bytes, got_marks) in totals.items():
        assert got_bytes == nbytes.get(stage, 0), (what, stage, got_bytes, nbytes)
        assert got_marks == marks.get(stage, 0), (what, stage, got_marks, marks)
        assert (seconds > 0) == (got_marks > 0), (what, stage, seconds, got_marks)


def test_stage_clock_counts_the_bytes_of_each_algorithms_schedule():
    """The stage clock against the bytes each schedule moves, worked out here from the schedules'
    comments: ring (reduce-scatter then allgather over segments part_begin(count, N, j)), shm in one
    pass and chunk by chunk, and MPI's allreduce; an odd count, not divisible by the world size. Time
    is counted exactly where a stage was marked, and nothing while the clock is stopped."""
    rank, size = pycomm.rank(), pycomm.size()
    topo = pycomm.topology()
    E = 4  # float32
    count = 300_007
    S = count * E
    x = rank_data(rank, count, torch.float32, seed=41)

    # ring: step t sends segment (r - t) mod N and receives (r - t - 1) mod N, 2(N-1) steps; the
    # first N-1 received segments are reduced (read both, write one).
    seg = [part_size(count, size, j) * E for j in range(size)]
    steps = range(2 * (size - 1))
    sent = sum(seg[(rank - t) % size] for t in steps)
    received = sum(seg[(rank - t - 1) % size] for t in steps)
    reduced = sum(seg[(rank - t - 1) % size] for t in range(size - 1))
    chunk_elems = max(1, pycomm.get_options()["ring_chunk_bytes"] // E)
    chunks = [-(-seg[(rank - t - 1) % size] // (chunk_elems * E)) for t in steps]  # received at step t
    totals = stage_totals(lambda: pycomm.allreduce(x, algorithm="ring"))
    if size == 1:
        expect_stages(totals, {}, {}, "ring")
    else:  # MPI marks: the first sends; per chunk received, its wait and (but at the last step) its send; the end
        expect_stages(totals, {"mpi": sent + received, "reduce": 3 * reduced},
                      {"mpi": 2 + sum(chunks) + sum(chunks[:-1]), "reduce": sum(chunks[:size - 1])}, "ring")

    totals = stage_totals(lambda: pycomm.allreduce(x, algorithm="mpi"))
    expect_stages(totals, *(({"mpi": S}, {"mpi": 1}) if size > 1 else ({}, {})), "mpi")  # one rank: no call

    L, me = topo.local_size, topo.local_rank
    if topo.num_nodes > 1 or L == 1:
        return
    # shm in one pass: copy in all but the own slice, fence, reduce the own slice in place with L-1 peers
    # and copy it in (a second copy-in mark), fence, copy out the peers' slices, fence.
    assert S <= pycomm._C.shm_pipeline_min_bytes(L, pycomm.get_options()["shm_chunk_bytes"])
    totals = stage_totals(lambda: pycomm.allreduce(x, algorithm="shm"))
    own = part_size(count, L, me) * E
    expect_stages(totals, {"copy_in": 2 * S, "reduce": 3 * (L - 1) * own, "copy_out": 2 * (S - own)},
                  {"copy_in": 2, "reduce": 1, "copy_out": 1, "barrier": 3}, "shm in one pass")

    # shm chunk by chunk, per chunk: copy in all but the own slice, fence, reduce the own slice in the
    # tensor and copy it into the window (a second copy-in mark), fence, copy out the peers' slices; a last fence.
    old = pycomm.get_options()["shm_chunk_bytes"]
    chunk_bytes = 40_000
    try:
        pycomm.set_options(shm_chunk_bytes=chunk_bytes)
        n = pycomm._C.shm_pipeline_min_bytes(L, chunk_bytes) // E + 12_345
        y = rank_data(rank, n, torch.float32, seed=42)
        chunk_elems = ((chunk_bytes + 63) & ~63) // E
        lens = [min(chunk_elems, n - b) for b in range(0, n, chunk_elems)]
        totals = stage_totals(lambda: pycomm.allreduce(y, algorithm="shm"))
    finally:
        pycomm.set_options(shm_chunk_bytes=old)
    own = [part_size(c, L, me) for c in lens]
    expect_stages(totals, {"copy_in": 2 * n * E, "copy_out": 2 * (n - sum(own)) * E,
                           "reduce": 3 * (L - 1) * E * sum(own)},
                  {"copy_in": 2 * len(lens), "reduce": len(lens), "copy_out": len(lens), "barrier": 2 * len(lens) + 1},
                  "shm chunk by chunk")

    # Stopped, the clock counts nothing.
    pycomm.allreduce(x, algorithm="shm")
    assert all(v == (0.0, 0, 0) for v in pycomm._C.stage_clock_take().values())


def test_timeline_from_environment_and_torch_profiler(tmp_path, monkeypatch):
    from pycomm import timeline

    rank = pycomm.rank()
    monkeypatch.setenv("PYCOMM_TIMELINE", str(tmp_path / "env.json"))
    timeline.start_from_env(rank)
    assert pycomm.timeline_path() == str(tmp_path / f"env.rank{rank}.json")
    pycomm.barrier()
    pycomm.stop_timeline()
    with open(tmp_path / f"env.rank{rank}.json") as f:
        assert any(e["name"] == "BARRIER" for e in json.load(f)["traceEvents"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pycomm.allreduce(torch.ones(4), name="profiled")
        pycomm.barrier()
    names = {e.name for e in prof.events()}
    assert {"pycomm.allreduce", "pycomm.barrier"} <= names, sorted(n for n in names if "pycomm" in n)
    with pytest.raises(ValueError, match="path is empty"):
        pycomm.start_timeline("")


def test_pycomm_train_every_sample_uneven_batches(tmp_path, comm):
    """121 samples, batch 10: ranks get 61/60 (2 ranks), 41/40/40 (3), 31/30/30/30 (4) samples, so the
    first ranks take one batch more; the others join, and every rank ends with the same model."""
    from pycomm.tools.train.cli import parse_args
    from pycomm.tools.train.loop import train

    rank, size = pycomm.rank(), pycomm.size()
    if size == 1:
        pytest.skip("needs ranks with different numbers of batches")
    rng = np.random.default_rng(3)
    path = tmp_path / "uneven.npz"
    np.savez(path, x_train=rng.normal(size=(121, 8)).astype(np.float32), y_train=rng.integers(0, 3, 121),
             x_test=rng.normal(size=(20, 8)).astype(np.float32), y_test=rng.integers(0, 3, 20))
    args = parse_args(["--dataset", f"npz:{path}", "--model", "mlp", "--batch-size", "10", "--epochs", "2",
                       "--every-sample", "--no-progress", "--no-bandwidth-table"])
    summary = train(args)
    mine = -(-(121 // size + (1 if rank < 121 % size else 0)) // 10)
    assert summary["steps"] == 2 * mine
    assert len(set(comm.allgather(summary["model_sha256"]))) == 1
    assert np.isfinite(summary["final_train_loss"])
