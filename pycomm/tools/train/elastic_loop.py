"""pycomm-train --elastic: training that goes on when ranks die (docs/elastic.md).

The loop of pycomm/train/loop.py reduced to what survives a change of world size: every step is
committed (model, local optimizer, algorithm state, the sampler's place in the epoch, the loop's
counters), and on a rank's death pycomm.elastic.run shrinks the job, returns every survivor to the
lowest surviving rank's last commit and calls the training function again; the ElasticSampler then
deals the epoch's unprocessed samples over the ranks left. Runs the algorithms with
``elastic_supported`` (ssgd, model_averaging, bmuf) with DistributedOptimizer, fp32, without
checkpoints, stragglers or dedicated servers (cli.py refuses the rest).
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from typing import Any, Dict

import torch
import torch.nn.functional as F

import pycomm
import pycomm.elastic as elastic

from ... import training
from .cli import UsageError
from .data import DataError, load_dataset
from .metrics import accuracy, epoch_line, fingerprint
from .models import build_model
from .optimizers import build_optimizer


class _AlgorithmState:
    """An algorithm's state_dict as an elastic state object. Its world size is the job's at load time:
    a commit made before ranks died loads into the smaller job (Algorithm.load_state_dict compares it)."""

    def __init__(self, algo):
        self.algo = algo

    def state_dict(self) -> Dict[str, Any]:
        return self.algo.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.algo.load_state_dict({**state, "world_size": self.algo.world_size})


def train_elastic(args) -> Dict[str, Any]:
    """Run the training described by parsed `args` in elastic mode; returns the summary (on every survivor)."""
    try:
        data = load_dataset(args.dataset)
    except (DataError, ValueError) as e:
        raise UsageError(str(e)) from None
    pycomm.init(elastic=True)
    start_rank = pycomm.rank()  # this process's rank in the job as launched (ranks renumber after a shrink)
    # A rank that grow started (pycomm-run --max-np) runs this command line too, --kill-at-step included;
    # it may have the victim's rank and resumes at the victim's step: it must not die again.
    kill_rank, kill_step = args.kill_at_step if args.kill_at_step and not elastic.joined() else (-1, -1)
    torch.manual_seed(args.seed)
    model = build_model(args.model, data.input_shape, data.num_classes)
    try:
        local_opt = build_optimizer(args.optimizer, model.parameters(), lr=args.lr, momentum=args.momentum,
                                    sgd_nesterov=args.sgd_nesterov, weight_decay=args.weight_decay,
                                    freeze_step=None, compression=getattr(args, "compression", "none"))
        algo = training.create(args.algorithm, model, local_opt, **args.algorithm_config)
    except (ValueError, training.base.JobConfigError) as e:
        raise UsageError(str(e)) from None
    n_train = len(data.y_train)
    sampler = elastic.ElasticSampler(range(n_train), shuffle=True, seed=args.seed)
    progress = {"epoch": 0, "global_step": 0, "loss_sum": 0.0, "loss_count": 0, "history": []}
    state = elastic.State(algorithm=_AlgorithmState(algo), sampler=sampler, progress=progress)
    state.register_reset_callbacks([algo.reset_after_failure, state.sampler.reset])
    t_start = time.perf_counter()
    reported = {"recoveries": 0}

    def log(line: str) -> None:
        if pycomm.rank() == 0:
            print(line, flush=True)

    log(f"pycomm-train: {args.algorithm} on {pycomm.size()} rank(s), elastic, {args.optimizer} local optimizer, "
        f"{args.model} on {data.name}, batch {args.batch_size} per rank")

    @elastic.run(state)
    def run_epochs(state) -> None:
        p = state.progress
        while p["epoch"] < args.epochs:
            if state.sampler.epoch != p["epoch"]:
                state.sampler.set_epoch(p["epoch"])
            idx = torch.tensor(list(state.sampler), dtype=torch.long)
            steps = math.ceil(len(idx) / args.batch_size)
            for s in range(steps):
                if start_rank == kill_rank and p["global_step"] == kill_step:
                    sys.stdout.write(f"pycomm-train: rank {start_rank} kills itself at step {kill_step} "
                                     f"(--kill-at-step) at {time.time()!r}\n")
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                b = idx[s * args.batch_size:(s + 1) * args.batch_size]
                algo.zero_grad()
                loss = F.cross_entropy(model(data.x_train[b]), data.y_train[b])
                loss.backward()
                algo.step()
                state.sampler.record_batch(s, len(b))
                p["global_step"] += 1
                p["loss_sum"] += float(loss.detach()) * len(b)
                p["loss_count"] += len(b)
                state.commit()
                if len(elastic.recoveries) > reported["recoveries"]:  # the time from a kill to the next step
                    reported["recoveries"] = len(elastic.recoveries)
                    print(f"pycomm-train: rank {start_rank} first step after recovery at {time.time()!r}", flush=True)
            tot = torch.tensor([p["loss_sum"], float(p["loss_count"])], dtype=torch.float64)
            pycomm.allreduce(tot, op="sum", algorithm="mpi", name="train.metrics")
            rec = {"epoch": p["epoch"] + 1, "train_loss": float(tot[0] / max(tot[1], 1.0)),
                   "test_accuracy": accuracy(algo.eval_model(), data.x_test, data.y_test),
                   "syncs": algo.num_syncs, "bytes_sent": algo.bytes_sent, "steps": algo.steps,
                   "wall_time_s": time.perf_counter() - t_start, "world_size": pycomm.size()}
            p["history"].append(rec)
            log(epoch_line(rec, args.epochs))
            p["epoch"] += 1
            p["loss_sum"], p["loss_count"] = 0.0, 0
            state.commit()
        algo.finalize()

    run_epochs()
    final = algo.eval_model()
    digest = fingerprint(final.parameters())
    digests = pycomm.world_comm().allgather(digest)
    history = state.progress["history"]
    summary = {
        "algorithm": args.algorithm, "config": dict(args.algorithm_config), "optimizer": args.optimizer,
        "model": args.model, "dataset": data.name, "elastic": True, "world_size": pycomm.size(),
        "epochs": args.epochs, "batch_size": args.batch_size, "seed": args.seed, "steps": algo.steps,
        "final_train_loss": history[-1]["train_loss"] if history else None,
        "final_test_accuracy": accuracy(final, data.x_test, data.y_test),
        "model_sha256": digest, "models_identical": len(set(digests)) == 1,
        "recoveries": [{"lost_ranks": list(r.lost), "size_before": r.size_before, "size_after": r.size_after,
                        "seconds": round(r.seconds, 4)} for r in elastic.recoveries],
        "growths": [{"added": g.added, "size_before": g.size_before, "size_after": g.size_after,
                     "seconds": round(g.seconds, 4)} for g in elastic.growths],
        "wall_time_s": round(time.perf_counter() - t_start, 3),
    }
    if pycomm.rank() == 0:
        if args.metrics_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_json)), exist_ok=True)
            with open(args.metrics_json, "w") as f:
                json.dump({"epochs": history, "summary": summary}, f, indent=1)
        print(json.dumps(summary), flush=True)
    return summary
