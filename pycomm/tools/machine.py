"""Measuring the cost model's constants (pycomm.cost_model.Machine) on a running job, for pycomm-tune.

``pycomm-tune`` stores them in ``machine.json`` (pycomm.auto_choice.model_path); ``bench/allreduce.py
--model`` prints the predictions beside its measurements. The model itself, and reading the stored
constants, are in the runtime (pycomm.cost_model, pycomm.auto_choice).
"""
from __future__ import annotations

from ..cost_model import Machine


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure(world, local, topo, iters: int = 21) -> Machine:
    """Measure the constants on this job (collective over `world`).

    alpha, beta: half the round trip of a ping-pong between world ranks 0 and 1
    (the same node when it has two ranks) at 8 B and 4 MiB; alpha_x, beta_x: the
    same between rank 0 and node 1's first rank (or alpha, beta on one node).
    gamma, delta, kappa, omega: pycomm's own kernels on 4 Mi float32 elements
    with every rank running at once (they share the memory bus in a collective
    too), medians; gamma_c: the reduction repeated on a 512 KiB pair that stays
    in cache, as a chunk of the shm pipeline does. (Operands twice the
    last-level cache give the memory-bound rates, closer to what 64-256 MiB
    messages see, but they ranked shm behind ring and mpi at 1 and 16 MiB on 2
    ranks where it was measured first: bench/allreduce.py --model.) sync: a barrier of the node. Latencies (ping-pong, barrier)
    take the minimum over samples: on an oversubscribed or shared machine most
    samples measure waiting for the peer's core, not the transport. Rank 0's
    values are broadcast, so every rank holds the same model.
    """
    import time

    import numpy as np
    import torch

    from .. import kernels

    def pingpong(peer_a: int, peer_b: int, nbytes: int) -> float:
        buf = np.zeros(max(1, nbytes), dtype=np.uint8)
        times = []
        for i in range(iters + 2):
            world.Barrier()
            t0 = time.perf_counter()
            if world.rank == peer_a:
                world.Send(buf, dest=peer_b, tag=77)
                world.Recv(buf, source=peer_b, tag=77)
            elif world.rank == peer_b:
                world.Recv(buf, source=peer_a, tag=77)
                world.Send(buf, dest=peer_a, tag=77)
            if i >= 2:
                times.append((time.perf_counter() - t0) / 2)
        return min(times)  # the uncontended cost: on a shared machine most samples wait for the peer's core

    big = 4 << 20
    alpha = beta = alpha_x = beta_x = 0.0
    if world.size > 1:
        t_small, t_big = pingpong(0, 1, 8), pingpong(0, 1, big)
        alpha, beta = t_small, max(0.0, (t_big - t_small) / big)
        alpha_x, beta_x = alpha, beta
        if topo.num_nodes > 1:
            other = topo.local_size  # world rank of node 1's first rank (nodes are consecutive blocks)
            t_small, t_big = pingpong(0, other, 8), pingpong(0, other, big)
            alpha_x, beta_x = t_small, max(0.0, (t_big - t_small) / big)

    n = big // 4
    a, b = torch.randn(n), torch.randn(n)
    dst = torch.empty(n)
    residual = torch.zeros(n)

    def per_byte(fn, nbytes: int = big) -> float:
        fn()
        times = []
        for _ in range(max(5, iters // 3)):
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return _median(times) / nbytes

    gamma = per_byte(lambda: kernels.reduce_(a, b))
    # In cache: a 512 KiB pair of operands (the order of the shm pipeline's chunk), reduced 8 times.
    small = 128 << 10
    ac, bc = a[:small].clone(), b[:small].clone()

    def reduce_in_cache():
        for _ in range(8):
            kernels.reduce_(ac, bc)

    gamma_c = per_byte(reduce_in_cache, 8 * small * 4)
    delta = per_byte(lambda: dst.copy_(b))
    # Into buffers made once, as the engine's cached buffers are: a fresh output per call
    # measured its page faults (kappa 2.3e-9 s/B at 2 ranks, 8.9e-11 with the buffer kept).
    half_out = torch.empty(n, dtype=torch.float16)
    kappa = per_byte(lambda: kernels.cast_to_half(b, out=half_out))
    bits, scales = kernels.onebit_compress(b, residual)
    omega = per_byte(lambda: kernels.onebit_compress(b, residual, bits=bits, scales=scales))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        local.Barrier()
        times.append(time.perf_counter() - t0)
    sync = min(times) if local.size > 1 else 0.0
    values = dict(alpha=alpha, beta=beta, gamma=gamma, delta=delta, sync=sync, alpha_x=alpha_x, beta_x=beta_x,
                  kappa=kappa, omega=omega, gamma_c=gamma_c)
    return Machine(**world.bcast(values if world.rank == 0 else None, root=0))
