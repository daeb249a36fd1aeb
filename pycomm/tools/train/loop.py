"""The training loop of pycomm-train.

Every rank loads and checks the data itself (same result everywhere, so a
bad input fails on every rank before training starts), builds the same model
from the seed, and runs ``algo.zero_grad(); loss.backward(); algo.step()``
over its shard of each epoch. Rank 0 shows the progress bar, the per-epoch
lines and the final JSON summary.

Under ``pycomm-run --servers K`` (PYCOMM_PS_SERVERS=K) with a parameter-server
algorithm, the last K ranks are dedicated servers: they build the algorithm
(its ParameterServer is collective), serve until the workers finish, and
return ``{"role": "server", ...}``; the data is sharded over the workers only,
and the metrics and the summary come from them.
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import time
import warnings
from typing import Any, Dict

import numpy as np
import torch
import torch.nn.functional as F

import pycomm

from ... import training
from . import bandwidth, checkpoint
from .cli import UsageError
from .data import DataError, check_batch, epoch_shard, every_sample_shard, load_dataset, steps_per_epoch
from .metrics import accuracy, epoch_line, fingerprint, mean_loss
from .models import build_model
from .optimizers import DEFAULT_LR, DEFAULT_MOMENTUM, SELF_REDUCING, build_optimizer, server_lr

CRASH_STATUS = 75
# The algorithms that run on pycomm.ps's ParameterServer with its placement from PYCOMM_PS_SERVERS.
PS_ALGORITHMS = ("asgd", "ssp", "dcasgd", "adadelay")

# Options that define the training trajectory; a resumed run must match them.
RESUME_KEYS = ("algorithm", "algorithm_config", "optimizer", "lr", "momentum", "sgd_nesterov", "weight_decay",
               "batch_size", "seed", "dataset", "model", "precision", "freeze_step", "every_sample")
RESUME_DEFAULTS = {"precision": "fp32", "freeze_step": None, "every_sample": False}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


#: A model whose training loss after an epoch (metrics.mean_loss on the first 2048 training samples) is at
#: least this fraction of ln(classes), the loss of a uniform guess (and whose accuracy is within a tenth of the
#: way from a uniform guess's to 100%), is at chance level: still (after epoch 1) or again (it diverged later). pycomm-train warns once
#: per run, at the first such epoch.
CHANCE_FRACTION = 0.95


def chance_warning(train_loss: float, train_accuracy: float, num_classes: int, args, lr: float,
                   epoch: int = 1) -> bool:
    """Warn if the model after `epoch` is at chance level; True if it did (the loop then stops asking).

    At chance: loss not finite or >= CHANCE_FRACTION ln(classes), and training accuracy (percent) less than a
    tenth of the way from a uniform guess's (100 / classes) to 100. The accuracy test keeps quiet for averaged
    models: their logits are small after the first averages, so the loss sits near ln(classes) while the
    argmax is right."""
    chance = math.log(num_classes)
    guess = 100.0 / num_classes
    if (math.isfinite(train_loss) and train_loss < CHANCE_FRACTION * chance) or \
            train_accuracy >= guess + 0.1 * (100.0 - guess):
        return False
    opt = args.optimizer
    if args.algorithm in training.server_sgd():
        cause = (f"the servers apply every worker's gradient with lr {lr:g} as it arrives, so N pushing workers "
                 "take N steps of that lr on stale weights; lower --lr (without --lr pycomm-train uses "
                 "sgd's lr / N) or --momentum")
    elif opt in SELF_REDUCING:
        cause = (f"--lr {lr:g} too large for {opt}, or a warm-up (--freeze-step) too short for the variance to "
                 "settle before it is frozen")
    else:
        cause = f"--lr {lr:g} too large for {opt} (or far too small)"
        if args.algorithm != "ssgd":  # measured: model_averaging on digits is here after epoch 1, then learns
            cause += f"; or {args.algorithm}'s averaged model has not caught up yet: see whether the next epochs learn"
    warnings.warn(f"pycomm-train: after epoch {epoch} the training loss is {train_loss:.3f} and the training "
                  f"accuracy {train_accuracy:.1f}% (the model at the end of the epoch on up to 2048 training "
                  f"samples), at chance level for {num_classes} classes (ln {num_classes} = {chance:.3f}, "
                  f"{100.0 / num_classes:.0f}%): the model is not learning. "
                  f"Likely cause: {cause}.", stacklevel=2)
    return True


def _run_identity(args) -> Dict[str, Any]:
    return {k: getattr(args, k, RESUME_DEFAULTS.get(k)) for k in RESUME_KEYS}


def train(args) -> Dict[str, Any]:
    """Run the training described by parsed `args`; returns the summary (on every rank)."""
    if getattr(args, "elastic", False):
        from .elastic_loop import train_elastic

        return train_elastic(args)
    try:
        data = load_dataset(args.dataset)
        probe = build_model(args.model, data.input_shape, data.num_classes)
    except (DataError, ValueError) as e:
        raise UsageError(str(e)) from None
    pycomm.init()
    rank, world = pycomm.rank(), pycomm.size()
    straggler = getattr(args, "straggler", None)
    if straggler is not None and straggler[0] >= world:
        raise UsageError(f"--straggler {straggler[0]}:{straggler[1]:g}: rank {straggler[0]} does not exist in a job "
                         f"of {world} rank(s)")
    slow_factor = straggler[1] if straggler is not None and straggler[0] == rank else 1.0
    eval_every = getattr(args, "eval_every", 0)
    # Dedicated parameter-server ranks (the last K) train nothing: the data is the workers'.
    from ...ps import servers_from_env

    dedicated = servers_from_env()
    if dedicated:
        if args.algorithm not in PS_ALGORITHMS:
            raise UsageError(f"pycomm-run --servers {dedicated} (PYCOMM_PS_SERVERS) places dedicated parameter-server "
                             f"ranks, which only {', '.join(PS_ALGORITHMS)} use; --algorithm {args.algorithm} would "
                             "leave them idle. Run without --servers.")
        if dedicated >= world:
            raise UsageError(f"pycomm-run --servers {dedicated}: a job of {world} rank(s) needs at least one worker")
        if args.checkpoint_dir or args.resume:
            raise UsageError("--checkpoint-dir/--resume with dedicated server ranks (--servers) is not supported: "
                             "checkpoints are written by every rank; use co-located servers (no --servers)")
        if straggler is not None and straggler[0] >= world - dedicated:
            raise UsageError(f"--straggler {straggler[0]}:{straggler[1]:g}: rank {straggler[0]} is a dedicated "
                             f"server (ranks {world - dedicated}..{world - 1}); name a worker rank")
    workers = world - dedicated
    wrank = rank if rank < workers else -1  # index among the workers (servers are the last ranks)
    try:
        check_batch(len(data.y_train), workers, args.batch_size)
    except DataError as e:
        raise UsageError(str(e)) from None
    del probe

    n_train = len(data.y_train)
    spe = steps_per_epoch(n_train, workers, args.batch_size)
    every_sample = getattr(args, "every_sample", False)
    if every_sample:  # ssgd only (workers == world): rank 0 has the largest shard, ceil(n / world) samples
        spe = (-(-n_train // world) + args.batch_size - 1) // args.batch_size
    total_steps = spe * args.epochs
    # onebit_adam/onebit_lamb: by default 15% of the run's steps are full-precision warm-up
    freeze_step = getattr(args, "freeze_step", None)
    if args.optimizer in SELF_REDUCING and freeze_step is None:
        freeze_step = max(1, (15 * total_steps) // 100)
    precision = getattr(args, "precision", "fp32")

    # Parameter-server algorithms: the servers apply each pushing worker's gradient with the lr (see
    # optimizers.server_lr); without --lr it is sgd's lr / pushers, with --lr exactly the lr given.
    server_note = None
    lr = args.lr
    if args.algorithm in training.server_sgd():
        pushers = workers
        if args.algorithm == "hybrid":  # one pusher per synchronous group
            from ...runtime import topology

            pushers = world // (args.algorithm_config.get("group_size") or topology().local_size)
        if lr is None:
            lr = server_lr(pushers)
            how = f"lr {lr:g} (default: sgd's {DEFAULT_LR['sgd']:g} / {pushers} pushing worker(s))"
        else:
            how = (f"lr {lr:g} as given (each of the {pushers} pushing worker(s)' gradients is applied in full: "
                   f"{pushers}x the step of SSGD at that lr)" if pushers > 1 else f"lr {lr:g} as given")
        mom = DEFAULT_MOMENTUM["sgd"] if args.momentum is None else args.momentum
        server_note = (f"pycomm-train: {args.algorithm}: the servers apply every pushed gradient as it arrives, "
                       f"SGD with {how}, momentum {mom:g}, weight decay {args.weight_decay:g}")

    seed_everything(args.seed)
    model = build_model(args.model, data.input_shape, data.num_classes)
    try:
        local_opt = build_optimizer(args.optimizer, model.parameters(), lr=lr, momentum=args.momentum,
                                    sgd_nesterov=args.sgd_nesterov, weight_decay=args.weight_decay,
                                    freeze_step=freeze_step, compression=getattr(args, "compression", "none"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    lr = float(local_opt.param_groups[0]["lr"])  # the default filled in, or --lr exactly
    if precision != "fp32":
        from .precision import MixedPrecisionSSGD

        algo = MixedPrecisionSSGD(model, local_opt, training.make_config("ssgd", **args.algorithm_config),
                                  precision=precision)
    else:
        try:
            algo = training.create(args.algorithm, model, local_opt, **args.algorithm_config)
        except training.base.JobConfigError as e:  # the same on every rank: report once, exit everywhere
            raise UsageError(str(e)) from None
    if dedicated and algo.is_server_only:
        algo.serve()  # until every worker has finalized
        if args.bandwidth_table:  # collective over every rank: the workers run it after finalize()
            bandwidth.measure()
        return {"role": "server", "rank": rank, "algorithm": args.algorithm, "world_size": world,
                "servers": dedicated}

    state = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "loss_sum": 0.0, "loss_count": 0,
             "history": [], "elapsed": 0.0}
    warmup = getattr(algo.config, "warmup_steps", None)
    if warmup is not None and warmup >= total_steps and total_steps > 0 and rank == 0:
        warnings.warn(f"pycomm-train: --warmup-steps is {warmup} but the run has only {total_steps} steps, so "
                      f"{args.algorithm} never leaves its warm-up: the whole run is plain synchronous SGD. "
                      "Lower --warmup-steps (e.g. --warmup-steps 0) or train longer.", stacklevel=1)
    if args.resume:
        step = checkpoint.latest_step(args.checkpoint_dir)
        if step is None:
            raise UsageError(f"--resume: no checkpoint in {args.checkpoint_dir!r} (no 'latest' marker)")
        # Every rank reads its own file; the ranks then agree on the outcome, so a
        # file missing or corrupt on one rank stops every rank with the same message.
        ck, problem = None, None
        try:
            ck = checkpoint.load(args.checkpoint_dir, step)
        except FileNotFoundError as e:
            problem = f"{e}; was the checkpoint made with a different number of ranks (this job has {world})?"
        except checkpoint.CheckpointError as e:
            problem = str(e)
        from mpi4py import MPI

        problems = [(r, p) for r, p in enumerate(MPI.COMM_WORLD.allgather(problem)) if p]
        if problems:
            raise UsageError("--resume: " + "; ".join(f"rank {r}: {p}" for r, p in problems))
        if ck.get("world_size", world) != world:
            raise UsageError(f"--resume: the checkpoint was made at {ck['world_size']} ranks, this job has {world}; "
                             "resume with the same number of ranks")
        # a checkpoint from before --precision/--freeze-step existed was made with their defaults
        saved = {**RESUME_DEFAULTS, **ck["run"]}
        mismatch = {k: (saved.get(k), v) for k, v in _run_identity(args).items() if saved.get(k) != v}
        if mismatch:
            raise UsageError("--resume: the checkpoint was made with different options: " + "; ".join(
                f"{k} was {old!r}, now {new!r}" for k, (old, new) in mismatch.items()))
        algo.load_state_dict(ck["algorithm"])
        state = ck["loop"]
        torch.set_rng_state(ck["torch_rng"])

    show = rank == 0
    bar = None
    if show and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=state["global_step"], desc=f"{args.algorithm} x{workers}",
                   unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.2, leave=False)

    def log(line: str) -> None:
        if not show:
            return
        if bar is not None:
            bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def save_checkpoint() -> None:
        payload = {"run": _run_identity(args), "world_size": world, "algorithm": algo.state_dict(), "loop": dict(state),
                   "torch_rng": torch.get_rng_state()}
        payload["loop"]["elapsed"] = state["elapsed"] + (time.perf_counter() - t_start)
        checkpoint.save(args.checkpoint_dir, state["global_step"], payload)

    if state["global_step"] == 0:
        log(f"pycomm-train: {args.algorithm} on {world} rank(s)"
            + (f" ({workers} workers, {dedicated} dedicated server rank(s))" if dedicated else "")
            + f", {args.optimizer} local optimizer"
            + (f" (freeze_step {freeze_step})" if args.optimizer in SELF_REDUCING else "")
            + (f", {precision} model with float32 master weights" if precision != "fp32" else "") + ", "
            f"{args.model} on {data.name} ({n_train} train / {len(data.y_test)} test samples), "
            f"batch {args.batch_size} per rank, {spe} steps per epoch")
        if server_note:
            log(server_note)
    else:
        log(f"pycomm-train: resumed at epoch {state['epoch'] + 1}, step {state['step_in_epoch']} of {spe} "
            f"(global step {state['global_step']})")

    t_start = time.perf_counter()
    model.train()
    while state["epoch"] < args.epochs:
        epoch = state["epoch"]
        if every_sample:
            idx = torch.from_numpy(every_sample_shard(n_train, world, rank, args.seed, epoch))
            my_steps = (len(idx) + args.batch_size - 1) // args.batch_size  # spe, or one less
        else:
            idx = torch.from_numpy(epoch_shard(n_train, workers, wrank, args.seed, epoch))
            my_steps = spe
        for s in range(state["step_in_epoch"], my_steps):
            b = idx[s * args.batch_size:(s + 1) * args.batch_size]
            x, y = data.x_train[b], data.y_train[b]
            t_compute = time.perf_counter()
            algo.zero_grad()
            # backup_sgd: a step decided by the first N gradients before this rank began is applied
            # without a forward and backward pass (and adds nothing to the epoch's mean loss)
            decided = algo.step_decided()
            loss = None
            if decided:
                pass
            elif precision != "fp32":
                loss = F.cross_entropy(model(algo.cast_input(x)).float(), y)
                algo.backward(loss)  # scaled by the loss scale
            else:
                # an algorithm with a loss of its own (ec_dnn: distillation towards the ensemble) supplies it
                loss = (algo.training_loss(model(x), x, y) if hasattr(algo, "training_loss")
                        else F.cross_entropy(model(x), y))
                loss.backward()
            if slow_factor > 1.0 and not decided:  # --straggler: this rank computes slow_factor times slower
                time.sleep((slow_factor - 1.0) * (time.perf_counter() - t_compute))
            algo.step()
            if loss is not None:
                state["loss_sum"] += float(loss.detach()) * len(b)
                state["loss_count"] += len(b)
            state["step_in_epoch"] = s + 1
            state["global_step"] += 1
            if eval_every and show and state["global_step"] % eval_every == 0:
                state.setdefault("curve", []).append(
                    {"step": state["global_step"], "wall_time_s": state["elapsed"] + (time.perf_counter() - t_start),
                     "test_accuracy": accuracy(algo.eval_model(), data.x_test, data.y_test)})
            if bar is not None:
                bar.update(1)
                if loss is not None:
                    bar.set_postfix(loss=f"{float(loss.detach()):.3f}", refresh=False)
            if args.checkpoint_dir and args.checkpoint_every and state["global_step"] % args.checkpoint_every == 0 \
                    and state["step_in_epoch"] < spe:
                algo.settle()  # a checkpoint is a collective (its barrier): backup_sgd closes its session first
                save_checkpoint()
            if args.crash_at_step is not None and state["global_step"] == args.crash_at_step:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(CRASH_STATUS)
        if every_sample:
            # Ranks with fewer batches answer the others' gradient allreduces with zeros (counted out of the
            # average) until all are done; then every rank takes the model of the last rank to finish.
            algo.optimizer.join()
        algo.settle()  # backup_sgd: closes the epoch's session before the metrics allreduce below
        # End of epoch: mean train loss over all ranks (a metrics allreduce, not a training sync).
        tot = torch.tensor([state["loss_sum"], float(state["loss_count"])], dtype=torch.float64)
        if dedicated:  # the server ranks are serving: the workers' own communicator
            from mpi4py import MPI

            algo.ps.worker_comm.Allreduce(MPI.IN_PLACE, tot.numpy(), op=MPI.SUM)
        else:
            pycomm.allreduce(tot, op="sum", algorithm="mpi", name="train.metrics")
        rec = {"epoch": epoch + 1, "train_loss": float(tot[0] / max(tot[1], 1.0)),
               "test_accuracy": accuracy(algo.eval_model(), data.x_test, data.y_test) if show else None,
               "syncs": algo.num_syncs, "bytes_sent": algo.bytes_sent, "steps": algo.steps,
               "wall_time_s": state["elapsed"] + (time.perf_counter() - t_start)}
        state["history"].append(rec)
        if show:
            log(epoch_line(rec, args.epochs))
            # the model as the epoch leaves it (an epoch's mean loss includes its start); warned once per run
            if not state.get("chance_warned"):
                m = algo.eval_model()
                state["chance_warned"] = chance_warning(
                    mean_loss(m, data.x_train, data.y_train), accuracy(m, data.x_train[:2048], data.y_train[:2048]),
                    data.num_classes, args, lr, rec["epoch"])
        state["epoch"] += 1
        state["step_in_epoch"] = 0
        state["loss_sum"], state["loss_count"] = 0.0, 0
        if args.checkpoint_dir:
            save_checkpoint()
    if bar is not None:
        bar.close()

    algo.finalize()
    wall = state["elapsed"] + (time.perf_counter() - t_start)
    final = algo.eval_model()
    summary = {
        "algorithm": args.algorithm, "config": dict(args.algorithm_config), "optimizer": args.optimizer,
        "model": args.model, "dataset": data.name, "world_size": world, "epochs": args.epochs,
        **({"workers": workers, "servers": dedicated} if dedicated else {}),
        "batch_size": args.batch_size, "seed": args.seed, "steps": algo.steps,
        "final_train_loss": state["history"][-1]["train_loss"] if state["history"] else None,
        "final_test_accuracy": accuracy(final, data.x_test, data.y_test) if show else None,
        "syncs": algo.num_syncs, "bytes_sent": algo.bytes_sent, "wall_time_s": round(wall, 3),
        "model_sha256": fingerprint(final.parameters()),
    }
    summary["precision"] = precision
    summary["lr"] = lr
    if args.optimizer in SELF_REDUCING:
        summary["freeze_step"] = freeze_step
    if precision != "fp32":
        summary["loss_scale"], summary["skipped_steps"] = algo.loss_scale, algo.skipped_steps
    if callable(getattr(algo, "summary", None)):  # the parameter-server algorithms: staleness
        summary.update(algo.summary())
    if straggler is not None:
        summary["straggler"] = {"rank": straggler[0], "factor": straggler[1]}
    if "curve" in state:
        summary["curve"] = state["curve"]
    if args.bandwidth_table:
        rows = bandwidth.measure()
        if show:
            log(bandwidth.format_table(rows, world))
        summary["allreduce_bandwidth"] = [{k: r[k] for k in ("size", "algorithm", "time_us", "busbw_GBps")}
                                          for r in rows]
    if show:
        if args.metrics_json:
            d = os.path.dirname(os.path.abspath(args.metrics_json))
            os.makedirs(d, exist_ok=True)
            with open(args.metrics_json, "w") as f:
                json.dump({"epochs": state["history"], "summary": summary}, f, indent=1)
        print(json.dumps(summary), flush=True)
    return summary
