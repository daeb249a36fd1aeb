"""Command-line options of pycomm-train.

The algorithm options are generated from the config dataclasses of
pycomm.training (``sync_period`` -> ``--sync-period``; booleans get a
``--no-`` form). An option given on the command line that is not a field of
the chosen algorithm's config is an error naming the options that apply.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Dict, List, Optional, Sequence

from ... import training
from ...training.bmuf import MOMENT_SYNC
from .models import MODELS
from .optimizers import ADAPTIVE, DEFAULT_LR, DEFAULT_MOMENTUM, ONEBIT_SGD_DEFAULTS, OPTIMIZERS, SELF_REDUCING

PRECISIONS = ("fp32", "fp16", "bf16")


class UsageError(ValueError):
    """Bad command line or input; reported as ``pycomm-train: error: ...`` with exit status 2."""


def launcher_rank() -> int:
    """This process's rank as the MPI launcher tells it, before MPI is initialized."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def _field_types(cls) -> Dict[str, type]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        args = typing.get_args(t)
        if args and type(None) in args:  # Optional[X]
            t = next(a for a in args if a is not type(None))
        out[f.name] = t
    return out


def algorithm_options() -> Dict[str, dict]:
    """field name -> {type, algorithms having it, help}."""
    opts: Dict[str, dict] = {}
    for name, cls in training.ALGORITHMS.items():
        for field, t in _field_types(cls.Config).items():
            entry = opts.setdefault(field, {"type": t, "algorithms": []})
            entry["algorithms"].append(name)
    return opts


OPTION_HELP = {
    "compression": "gradient compression",
    "backward_passes_per_step": "backward passes accumulated per gradient reduction",
    "bucket_mb": "gradient bucket size in MiB",
    "sync_period": "local steps between synchronizations (tau)",
    "block_momentum": "block momentum (default 1 - 1/N)",
    "block_lr": "block learning rate",
    "nesterov": "Nesterov block momentum (NBM) instead of classic (CBM)",
    "reset_local_momentum": "zero the local SGD momentum after each block sync",
    "warmup_steps": "plain SSGD steps before the first block",
    "moment_sync": "Adam moments at a block sync",
    "beta": "moving rate of the centre variable",
    "alpha": "elastic pull on each worker (default beta / N)",
    "rho": "ADMM penalty parameter",
    "local_steps": "local optimizer steps per ADMM round",
    "backup_workers": "B: of the ranks, each step averages the first (ranks - B) gradients to arrive and drops B",
}


def _defaults() -> Dict[str, Dict[str, object]]:
    out: Dict[str, Dict[str, object]] = {}
    for name, cls in training.ALGORITHMS.items():
        for f in dataclasses.fields(cls.Config):
            out.setdefault(f.name, {})[name] = f.default
    return out


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one rank speaks; every rank exits
        if launcher_rank() == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pycomm-train",
        description="Data-parallel training with pycomm's algorithms: synchronous ("
                    + ", ".join(n for n in training.names() if n not in training.server_sgd() and n != "hogwild")
                    + "), through parameter servers (" + ", ".join(training.server_sgd()) + ") and "
                    "lock-free on one node (hogwild). Launch under pycomm-run, e.g. "
                    "`pycomm-run -np 4 pycomm-train --algorithm ssgd --dataset digits --model mlp --epochs 5`.",
    )
    ps = ", ".join(training.server_sgd())
    g = p.add_argument_group("training")
    g.add_argument("--algorithm", default="ssgd", help=f"one of {', '.join(training.names())} (default ssgd)")
    g.add_argument("--optimizer", default="sgd", help=f"local optimizer, one of {', '.join(OPTIMIZERS)} (default "
                                                      f"sgd; {ps}: sgd only, their servers apply it)")
    g.add_argument("--lr", type=float, default=None,
                   help="learning rate, used exactly as given (default per optimizer: "
                        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items())
                        + f"; sgd with --compression onebit {ONEBIT_SGD_DEFAULTS['lr']:g}"
                        + f"; {ps}: the servers' lr, default sgd's {DEFAULT_LR['sgd']:g} divided by the number of "
                          "workers that push, see docs/training-defaults.md)")
    g.add_argument("--momentum", type=float, default=None,
                   help="momentum of " + "/".join(DEFAULT_MOMENTUM) + " (default "
                        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_MOMENTUM.items())
                        + f"; sgd with --compression onebit {ONEBIT_SGD_DEFAULTS['momentum']:g}; {ps}: the servers' "
                        "momentum)")
    g.add_argument("--sgd-nesterov", action="store_true",
                   help=f"Nesterov momentum in the local SGD (not {ps}: their servers apply plain momentum)")
    g.add_argument("--weight-decay", type=float, default=0.0,
                   help=f"weight decay of the optimizer (default 0; {ps}: the servers' weight decay)")
    g.add_argument("--freeze-step", type=int, default=None,
                   help="onebit_adam/onebit_lamb: warm-up steps with full-precision reduction before the variance "
                        "is frozen and the momentum is 1-bit compressed (default: 15%% of the run's steps)")
    g.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="fp32, or fp16/bf16 model with float32 master weights, gradients reduced in half "
                        "precision and dynamic loss scaling (pycomm.optim.MixedPrecision; --algorithm ssgd only)")
    g.add_argument("--batch-size", type=int, default=16, help="minibatch per rank (default 16)")
    g.add_argument("--epochs", type=int, default=5)
    g.add_argument("--seed", type=int, default=0, help="model init and data order (default 0)")
    g.add_argument("--every-sample", action="store_true",
                   help="use every training sample each epoch: the first (samples mod ranks) ranks get one sample "
                        "more, so ranks may have different numbers of batches; a rank that runs out joins "
                        "(pycomm.join) and is counted out of the others' gradient average "
                        "(--algorithm ssgd, sgd-style local optimizers, --compression none, fp32). Default: every "
                        "rank takes samples // ranks and the remainder is left out")
    g.add_argument("--dataset", default="digits",
                   help="digits | synthetic | synthetic-large | npz:PATH (default digits; digits needs "
                        "pip install 'pycomm[train]')")
    g.add_argument("--model", default="mlp", help=f"one of {', '.join(MODELS)} (default mlp)")

    a = p.add_argument_group("algorithm options (each belongs to the algorithms named)")
    defaults = _defaults()
    for field, info in algorithm_options().items():
        t = info["type"]
        vals = {v for v in defaults[field].values()}
        default = "" if vals == {None} else (f", default {vals.pop()}" if len(vals) == 1 else ", default " + ", ".join(
            f"{v} for {a}" for a, v in defaults[field].items()))
        who = f"{OPTION_HELP.get(field, field)} [{', '.join(info['algorithms'])}{default}]"
        if t is bool:
            a.add_argument(flag(field), dest=field, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=who)
        else:
            kw = {"choices": list(MOMENT_SYNC)} if field == "moment_sync" else {}
            a.add_argument(flag(field), dest=field, type=t, default=argparse.SUPPRESS, help=who, **kw)

    s = p.add_argument_group("stragglers and curves")
    s.add_argument("--straggler", default=None, metavar="RANK:FACTOR",
                   help="make rank RANK FACTOR times slower per step: after its forward and backward it sleeps "
                        "(FACTOR - 1) times their duration (e.g. 3:3)")
    s.add_argument("--eval-every", type=int, default=0, metavar="STEPS",
                   help="rank 0 also measures test accuracy every STEPS of its steps, for accuracy against wall "
                        "time (0: per epoch only)")

    o = p.add_argument_group("output and state")
    o.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (every epoch, and every "
                                                          "--checkpoint-every steps)")
    o.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: per epoch only)")
    o.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    o.add_argument("--metrics-json", default=None, help="rank 0 writes per-epoch metrics and the summary here")
    o.add_argument("--bandwidth-table", action=argparse.BooleanOptionalAction, default=True,
                   help="end with a short allreduce bandwidth table (default on)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--elastic", action="store_true",
                   help="survive the death of ranks (docs/elastic.md; launch with pycomm-run --elastic): every "
                        "step is committed, and the survivors go on from the last commit; ssgd, model_averaging "
                        "and bmuf")
    o.add_argument("--kill-at-step", default=None, metavar="RANK:STEP",
                   help="with --elastic: rank RANK kills itself (SIGKILL) before global step STEP, to try recovery")
    o.add_argument("--crash-at-step", type=int, default=None,
                   help="testing aid: every rank exits abruptly (status 75, no cleanup) after this global step, "
                        "as if the job had been killed")
    return p


def algorithm_config(args: argparse.Namespace) -> dict:
    """The algorithm options given on the command line; UsageError for ones the algorithm lacks."""
    name = args.algorithm
    if name not in training.ALGORITHMS:
        raise UsageError(f"unknown algorithm {name!r}; choose one of {', '.join(training.names())}")
    fields = set(training.config_fields(name))
    given = {f: getattr(args, f) for f in algorithm_options() if hasattr(args, f)}
    foreign = sorted(f for f in given if f not in fields)
    if foreign:
        own = ", ".join(flag(f) for f in training.config_fields(name)) or "(none)"
        raise UsageError(f"{', '.join(flag(f) for f in foreign)} does not apply to --algorithm {name}; "
                         f"its options are: {own}")
    return given


def parse_straggler(spec: Optional[str]):
    """'RANK:FACTOR' -> (rank, factor); None stays None. The rank is checked against the job in train()."""
    if spec is None:
        return None
    parts = str(spec).split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        rank, factor = int(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"--straggler expects RANK:FACTOR (e.g. 3:3), got {spec!r}") from None
    if rank < 0 or not factor >= 1.0:
        raise ValueError(f"--straggler {spec}: RANK must be >= 0 and FACTOR >= 1 (1: no slowdown)")
    return rank, factor


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.optimizer not in OPTIMIZERS:
        p.error(f"unknown optimizer {args.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if args.model not in MODELS:
        p.error(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)}")
    if args.epochs < 1:
        p.error(f"--epochs must be at least 1, got {args.epochs}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be >= 0")
    if args.algorithm in training.server_sgd():
        if args.optimizer != "sgd":
            p.error(f"--algorithm {args.algorithm}: the parameter servers apply SGD (the sgd optimizer's lr, "
                    f"momentum and weight decay are their rule); --optimizer {args.optimizer} does not apply, "
                    "use --optimizer sgd")
        if args.sgd_nesterov:
            p.error(f"--algorithm {args.algorithm}: the parameter servers apply plain momentum; "
                    "--sgd-nesterov does not apply")
    if args.optimizer in SELF_REDUCING and args.algorithm != "ssgd":
        p.error(f"--optimizer {args.optimizer} is the whole data-parallel step (it averages gradients, then "
                f"1-bit compressed momenta, itself); use it with --algorithm ssgd, not {args.algorithm}")
    if args.freeze_step is not None and args.optimizer not in SELF_REDUCING:
        p.error(f"--freeze-step applies to {' and '.join(SELF_REDUCING)}, not to {args.optimizer}")
    if args.freeze_step is not None and args.freeze_step < 0:
        p.error(f"--freeze-step must be >= 0, got {args.freeze_step}")
    if args.precision != "fp32":
        if args.algorithm != "ssgd":
            p.error(f"--precision {args.precision} applies to --algorithm ssgd (pycomm.optim.MixedPrecision reduces "
                    f"the gradients), not to {args.algorithm}")
        if getattr(args, "compression", "none") != "none":
            p.error(f"--precision {args.precision} reduces the gradients in {args.precision} already; "
                    f"--compression {args.compression} does not apply")
        if getattr(args, "backward_passes_per_step", 1) != 1:
            p.error(f"--precision {args.precision} takes one backward pass per step; "
                    "--backward-passes-per-step does not apply")
    elif args.optimizer == "lars" and getattr(args, "compression", "none") == "onebit" \
            and "compression" in training.config_fields(args.algorithm):
        # measured on digits at 4 ranks, pycomm-train's defaults, seeds 0-2: 82.5, 83.6, 81.9% (10.03% while
        # lars excluded the biases); lars without compression 93.3% (docs/training-defaults.md §6)
        p.error("--optimizer lars with --compression onebit stays below the accuracy of the other combinations "
                "(measured: 81.9-83.6% on digits at pycomm-train's defaults against 93.3% uncompressed, "
                "docs/training-defaults.md); use --compression fp16 or none with lars, or --optimizer sgd with "
                "--compression onebit")
    elif args.optimizer in ADAPTIVE and getattr(args, "compression", "none") == "onebit" \
            and "compression" in training.config_fields(args.algorithm):
        # optimizers.ADAPTIVE: a second moment of 1-bit gradients measures the compression, not the gradient
        p.error(f"--optimizer {args.optimizer} divides by a second moment of the gradients, which 1-bit "
                "compression distorts and error feedback cannot correct; use --optimizer onebit_adam or "
                "onebit_lamb (they compress the momentum after a full-precision warm-up), or --optimizer sgd "
                "with --compression onebit")
    elif args.optimizer in SELF_REDUCING and getattr(args, "compression", "none") != "none":
        p.error(f"--optimizer {args.optimizer} compresses its momentum itself; --compression {args.compression} "
                "does not apply")
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0")
    if args.every_sample:
        if args.algorithm != "ssgd" or args.optimizer in SELF_REDUCING or args.precision != "fp32":
            p.error("--every-sample needs --algorithm ssgd with DistributedOptimizer (not a self-reducing optimizer, "
                    "fp32): a rank that has run out of batches joins the gradient allreduces of the others")
        if getattr(args, "compression", "none") != "none":
            p.error(f"--every-sample: a rank that has joined cannot answer compressed allreduces; "
                    f"--compression {args.compression} does not apply")
        if args.checkpoint_every:
            p.error("--every-sample: ranks end an epoch after different numbers of steps; checkpoint per epoch "
                    "(leave out --checkpoint-every)")
    if args.elastic:
        if not getattr(training.get(args.algorithm), "elastic_supported", False):
            kind = ("parameter-server algorithms cannot lose a server or re-split a worker's shard"
                    if args.algorithm in training.server_sgd() else "it cannot go on after ranks died")
            p.error(f"--elastic: --algorithm {args.algorithm} does not support elastic mode ({kind}); "
                    "use ssgd, model_averaging or bmuf")
        if args.optimizer in SELF_REDUCING or args.precision != "fp32":
            p.error("--elastic runs fp32 training through DistributedOptimizer; leave out --precision and the "
                    "self-reducing optimizers (onebit_adam, onebit_lamb)")
        for flag_name, given in (("--checkpoint-dir", args.checkpoint_dir), ("--resume", args.resume),
                                 ("--every-sample", args.every_sample), ("--straggler", args.straggler),
                                 ("--crash-at-step", args.crash_at_step is not None),
                                 ("--eval-every", args.eval_every)):
            if given:
                p.error(f"--elastic: {flag_name} is not supported in elastic mode (its state is commits in memory)")
    if args.kill_at_step is not None:
        if not args.elastic:
            p.error("--kill-at-step needs --elastic (without it a killed rank ends the job)")
        try:
            kill_rank, kill_step = (int(v) for v in args.kill_at_step.split(":"))
        except ValueError:
            p.error(f"--kill-at-step {args.kill_at_step!r}: expected RANK:STEP, e.g. 2:15")
        args.kill_at_step = (kill_rank, kill_step)
    try:
        args.straggler = parse_straggler(args.straggler)
    except ValueError as e:
        p.error(str(e))
    try:
        args.algorithm_config = algorithm_config(args)
        training.make_config(args.algorithm, **args.algorithm_config)  # value checks
    except (UsageError, ValueError, TypeError) as e:
        p.error(str(e))
    return args
