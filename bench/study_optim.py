"""Study: large-batch optimizers at 4 ranks, final test accuracy against the batch size per rank.

    python bench/study_optim.py [--np 4] [--seeds 0 1 2] [--batch-sizes 16 64 256 512] [--epochs 3] [--out DIR]

Task: pycomm-train's synthetic 10-class Gaussian mixture of 8x8 inputs with
16,384 training and 10,000 test samples, the MLP of pycomm-train (64-128-128-10,
ReLU). Every run trains the same number of epochs, so a larger batch takes
fewer steps (4096 / b per epoch at 4 ranks): the regime where large batches
hurt plain SGD. All runs in one ``pycomm-run -np N`` job; every rank shards
each epoch as pycomm-train does. Learning rates (b = batch per rank, base 16):

- SGD: momentum 0.9, lr 0.05 * b/16 (linear scaling, Goyal et al. 2017);
- LARS: momentum 0.9, trust coefficient 0.001, lr 2 * sqrt(b/16), biases excluded;
- LAMB: lr 0.01 * sqrt(b/16) (square-root scaling, You et al. 2019), biases excluded;
- Adam and OneBitAdam: lr 0.002 * sqrt(b/16); OneBitAdam freezes the variance after the first epoch;
- LARS fp16: LARS as above through pycomm.optim.MixedPrecision (fp16 model, fp32 masters, dynamic loss scale).

Every run warms the learning rate up linearly over the first epoch, then keeps it.
SGD, LARS, LAMB, Adam and LARS fp16 reduce gradients with DistributedOptimizer (or
MixedPrecision in fp16); OneBitAdam is its own data-parallel step. Wire bytes:
per rank, ring estimate 2(N-1)/N * payload for full-precision allreduces, the
1-bit wire format for OneBitAdam's compressed momenta.

Writes study_optim.md (table), study_optim.json (every run) and study_optim.png.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import study_runner  # noqa: E402  (bench/, on sys.path as the script's folder)

RUNS = ["SGD (linear scaling)", "LARS", "LAMB", "Adam", "OneBitAdam", "LARS fp16"]
N_TRAIN, N_TEST = 16384, 10000


def build(label: str, model, b: int, steps_per_epoch: int):
    """(optimizer to step, base optimizer whose lr is scheduled, peak lr, mixed precision wrapper or None)."""
    import torch

    from pycomm.optim import LAMB, LARS, MixedPrecision, OneBitAdam
    from pycomm.optimizer import DistributedOptimizer

    r = b / 16
    if label.startswith("SGD"):
        base, lr = torch.optim.SGD(model.parameters(), lr=0.05 * r, momentum=0.9), 0.05 * r
    elif label.startswith("LARS"):
        base, lr = LARS(model.parameters(), lr=2.0 * math.sqrt(r), momentum=0.9), 2.0 * math.sqrt(r)
    elif label == "LAMB":
        base, lr = LAMB(model.parameters(), lr=0.01 * math.sqrt(r)), 0.01 * math.sqrt(r)
    elif label == "Adam":
        base, lr = torch.optim.Adam(model.parameters(), lr=0.002 * math.sqrt(r)), 0.002 * math.sqrt(r)
    elif label == "OneBitAdam":
        base = OneBitAdam(model.parameters(), lr=0.002 * math.sqrt(r), freeze_step=steps_per_epoch)
        return base, base, 0.002 * math.sqrt(r), None
    else:
        raise ValueError(label)
    if label.endswith("fp16"):
        mp = MixedPrecision(model, base, dtype=torch.float16)
        return mp, base, lr, mp
    return DistributedOptimizer(base, model.named_parameters()), base, lr, None


def train_epochs(opt, base, peak, mp, model, data, world, rank, seed, epochs, spe, b, half) -> None:
    import torch
    import torch.nn.functional as F

    from pycomm.tools.train.data import epoch_shard

    step = 0
    for epoch in range(epochs):
        idx = torch.from_numpy(epoch_shard(N_TRAIN, world, rank, seed, epoch))
        for s in range(spe):
            lr = peak * min(1.0, (step + 1) / spe)  # linear warm-up over the first epoch
            for g in base.param_groups:
                g["lr"] = lr
            bi = idx[s * b:(s + 1) * b]
            x, y = data.x_train[bi], data.y_train[bi]
            opt.zero_grad()
            if mp is not None:
                mp.backward(F.cross_entropy(model(x.to(half)).float(), y))
            else:
                F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1


def one_run(label: str, b: int, seed: int, epochs: int, data) -> dict:
    import numpy as np
    import torch

    import pycomm
    from pycomm.optimizer import ring_bytes_sent
    from pycomm.tools.train.metrics import accuracy
    from pycomm.tools.train.models import build_model

    world, rank = pycomm.size(), pycomm.rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    model = build_model("mlp", data.input_shape, data.num_classes)  # same seed: same model on every rank
    spe = N_TRAIN // world // b
    opt, base, peak, mp = build(label, model, b, spe)
    half = torch.float16 if mp is not None else None
    t0 = time.perf_counter()
    try:
        train_epochs(opt, base, peak, mp, model, data, world, rank, seed, epochs, spe, b, half)
        step, diverged = epochs * spe, None
    except pycomm.CommError as e:
        # OneBitAdam's compressed allreduce refuses inf/NaN momenta on every rank (the same decision
        # everywhere): the run diverged; it is recorded as such, evaluated as it stands.
        if "inf or NaN" not in str(e):
            raise
        step, diverged = opt.state[next(iter(model.parameters()))]["step"].item(), str(e).split(";")[0]
    wall = time.perf_counter() - t0
    if mp is not None:
        eval_model = build_model("mlp", data.input_shape, data.num_classes)
        with torch.no_grad():
            for dst, src in zip(eval_model.parameters(), mp.master_params()):
                dst.copy_(src)
    else:
        eval_model = model
    n_params = sum(p.numel() for p in model.parameters())
    if label == "OneBitAdam":
        sent, warm, comp = opt.bytes_sent, opt.bytes_sent_warmup, opt.bytes_sent_compressed
    elif mp is not None:
        sent = ring_bytes_sent(mp.bytes_reduced, world) + step * ring_bytes_sent(4, world)
        warm, comp = sent, 0
    else:
        sent = ring_bytes_sent(4 * n_params, world) * step
        warm, comp = sent, 0
    return {"label": label, "batch_per_rank": b, "seed": seed, "world_size": world, "steps": int(step),
            "diverged": diverged,
            "freeze_step": spe if label == "OneBitAdam" else None,
            "final_test_accuracy": accuracy(eval_model, data.x_test, data.y_test) if rank == 0 else None,
            "bytes_sent": sent, "bytes_sent_full_precision": warm, "bytes_sent_compressed": comp,
            "skipped_steps": mp.num_skipped if mp is not None else None, "wall_time_s": round(wall, 3)}


def worker(opts) -> None:
    sys.path.insert(0, ROOT)
    import pycomm
    from pycomm.tools.train.data import _synthetic

    pycomm.init()
    data = _synthetic(n_train=N_TRAIN, n_test=N_TEST)
    out = open(opts.results, "a") if pycomm.rank() == 0 else None
    for b in opts.batch_sizes:
        for label in RUNS:
            for seed in opts.seeds:
                rec = one_run(label, b, seed, opts.epochs, data)
                if out:
                    study_runner.append_record(out, rec)
                    print(f"b={b:<4} {label:<22} seed {seed}: acc {rec['final_test_accuracy']:.2f}%  "
                          f"steps {rec['steps']}  {rec['wall_time_s']:.1f}s"
                          + (f"  DIVERGED: {rec['diverged']}" if rec["diverged"] else ""), flush=True)


stats = study_runner.stats


def report(records: List[dict], opts) -> str:
    from pycomm.tools.train.metrics import human_bytes

    bs = sorted({r["batch_per_rank"] for r in records})
    lines = [f"Synthetic 10-class task ({N_TRAIN} train / {N_TEST} test), MLP, {opts.np} ranks, {opts.epochs} epochs "
             f"at every batch size, seeds {' '.join(map(str, opts.seeds))}: final test accuracy (%), mean ± standard "
             f"deviation over seeds. Columns: batch per rank (global batch = {opts.np} x).",
             "",
             "| run | " + " | ".join(f"b={b} ({opts.np * b})" for b in bs) + " |",
             "|---|" + "---:|" * len(bs)]
    for label in RUNS:
        cells = []
        for b in bs:
            rs = [r for r in records if r["label"] == label and r["batch_per_rank"] == b]
            m, sd = stats([r["final_test_accuracy"] for r in rs])
            nd = sum(1 for r in rs if r.get("diverged"))
            cells.append((f"{m:.2f} ± {sd:.2f}" + (f" ({nd} of {len(rs)} diverged)" if nd else "")) if rs else "—")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "A diverged run (inf/NaN momentum, refused by the compressed allreduce on every rank) stops there "
              "and is evaluated as it stands; it counts in the mean.", "",
              "Wire bytes per rank over the whole run (mean over seeds); OneBitAdam split into its "
              "full-precision warm-up (first epoch) and its 1-bit compressed steps (runs that did not diverge), and the ratio of a compressed "
              "step's bytes to an Adam step's bytes.", "",
              "| batch per rank | steps | Adam | OneBitAdam (warm-up + compressed) | compressed step / Adam step |",
              "|---:|---:|---:|---:|---:|"]
    for b in bs:
        adam = [r for r in records if r["label"] == "Adam" and r["batch_per_rank"] == b]
        ob = [r for r in records if r["label"] == "OneBitAdam" and r["batch_per_rank"] == b and not r["diverged"]]
        if not adam or not ob:
            continue
        steps, fz = ob[0]["steps"], ob[0]["freeze_step"]
        a_sent = stats([r["bytes_sent"] for r in adam])[0]
        w, c = stats([r["bytes_sent_full_precision"] for r in ob])[0], stats([r["bytes_sent_compressed"] for r in ob])[0]
        ratio = (c / max(1, steps - fz)) / (a_sent / steps) if steps > fz and a_sent else float("nan")
        lines.append(f"| {b} | {steps} | {human_bytes(a_sent)} | {human_bytes(w + c)} ({human_bytes(w)} + "
                     f"{human_bytes(c)}) | {ratio:.3f} |")
    skipped = [r["skipped_steps"] for r in records if r["label"] == "LARS fp16"]
    if skipped:
        lines += ["", f"LARS fp16: {sum(skipped)} overflow-skipped steps over {len(skipped)} runs "
                      f"(each rank-agreed, scale halved)."]
    return "\n".join(lines) + "\n"


def plot(records: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = sorted({r["batch_per_rank"] for r in records})
    fig, ax = plt.subplots(figsize=(8, 5))
    for label in RUNS:
        ms, sds, xs = [], [], []
        for b in bs:
            rs = [r["final_test_accuracy"] for r in records if r["label"] == label and r["batch_per_rank"] == b]
            if rs:
                m, sd = stats(rs)
                ms.append(m), sds.append(sd), xs.append(b)
        ax.errorbar(xs, ms, yerr=sds, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size per rank (4 ranks, same epochs)")
    ax.set_ylabel("final test accuracy (%), mean ± sd over seeds")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.suptitle("pycomm.optim: accuracy against batch size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_runner.add_job_arguments(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 256, 512])
    p.add_argument("--epochs", type=int, default=3)
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return 0
    if any(b < 1 or N_TRAIN // opts.np // b < 1 for b in opts.batch_sizes):
        p.error(f"every batch size must be between 1 and {N_TRAIN // opts.np} (a rank's shard)")
    results = study_runner.fresh_results(opts.out, "study_optim")
    rc = study_runner.launch("study_optim", opts.np, __file__,
                             ["--worker", "--results", results, "--epochs", str(opts.epochs),
                              "--seeds", *map(str, opts.seeds), "--batch-sizes", *map(str, opts.batch_sizes)])
    if rc != 0:
        return rc
    records = study_runner.read_records(results)
    sys.path.insert(0, ROOT)
    study_runner.write_outputs(opts.out, "study_optim", report(records, opts), records, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
