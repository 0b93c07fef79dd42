"""The options of ``paratrain train``, shared by the front-end (which checks them
before starting anything) and the workers (which receive the same words).

The options every strategy shares are here; each strategy adds its own
(strategies/, one argument group each), and --strategy offers the names in
strategies.STRATEGIES."""
import argparse

from ..launch import binding
from .slowdown import jitter_spec, straggler_spec

OPTIMIZERS = ("sgd", "adam")


def positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def positive_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def build_parser():
    from .strategies import DEFAULT, STRATEGIES, modules
    from .tasks import TASKS
    p = argparse.ArgumentParser(
        prog="paratrain train", allow_abbrev=False,
        description="Train a built-in model on several local worker processes with data parallelism. "
                    "With no arguments: the digits classifier on 2 workers.")
    p.add_argument("--model", default="digits", choices=TASKS,
                   help="built-in task: digits (CNN on scikit-learn's digits), gpt (character-level GPT on "
                        "the Python standard library's source), mlp / mlp-large (benchmark MLPs on synthetic data), "
                        "recsys (click prediction with a large embedding table), hf-gpt2 / hf-llama / hf-bert "
                        "(small Hugging Face models on the same text as gpt; needs pip install -e '.[hf]')")
    p.add_argument("--workers", "-n", type=positive_int, default=2, help="worker processes (default 2)")
    p.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (default: the task's)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="samples per worker per step")
    p.add_argument("--lr", type=positive_float, default=None, help="learning rate (default: the task's)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="default: the task's")
    p.add_argument("--strategy", choices=list(STRATEGIES), default=DEFAULT,
                   help="; ".join(module.HELP for module in modules()))
    p.add_argument("--dp", type=positive_int, default=None,
                   help="data-parallel replicas: sets --workers to dp x pp x tp")
    p.add_argument("--pp", type=positive_int, default=None,
                   help="pipeline stages: --strategy pipeline --stages PP")
    p.add_argument("--straggler", type=straggler_spec, default=None, metavar="RANK:FACTOR",
                   help="make worker RANK compute FACTOR times slower on every step (a persistently slow "
                        "machine): it sleeps (FACTOR - 1) x its measured forward+backward time")
    p.add_argument("--jitter", type=jitter_spec, default=None, metavar="P:FACTOR",
                   help="on each step, each worker computes FACTOR times slower with probability P (transient "
                        "hiccups), drawn from a generator seeded by --seed and the rank")
    p.add_argument("--target-loss", type=positive_float, default=None, metavar="X",
                   help="report in the summary when the loss first reached X (time to a fixed loss)")
    p.add_argument("--backend", default=None, choices=("shm", "torch"),
                   help="communication engine (default: shm on one host)")
    p.add_argument("--threads", type=positive_int, default=1, help="compute threads per worker (default 1)")
    p.add_argument("--bind-to", dest="bind_to", choices=binding.MODES, default="none",
                   help="pin each worker to its own --threads CPUs (core), or let the kernel place them "
                        "(none, the default); as paratrain run --bind-to")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order (default 0)")
    p.add_argument("--checkpoint-every", type=positive_int, default=None,
                   help="save runs/<id>/checkpoint.pt every N steps (always at the end)")
    p.add_argument("--eval-every", type=positive_int, default=None, help="evaluate every N steps (default: the task's)")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT",
                   help="continue from a checkpoint, e.g. runs/<id>/checkpoint.pt")
    p.add_argument("--runs", default="runs", help="folder for run directories (default ./runs)")
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)  # set by the front-end for the workers
    for module in modules():   # each strategy's own flags, in a group of its own after these
        module.add_options(p)
    return p


def _given(argv, *flags):
    return any(a in flags or a.startswith(tuple(f + "=" for f in flags)) for a in argv)


def resolve_layout(args, argv):
    """The mesh's names, ``--dp``, ``--pp`` and ``--tp`` (as pt.mesh), into what the
    strategies read: ``--pp N`` (N > 1) is the pipeline strategy with N stages, and
    ``--dp D`` makes ``--workers`` D x pp x tp (D = 1 when only --pp or --tp is
    given and --workers is not). Run on the front-end and on every
    worker (which get the same words). Returns what is wrong, or None."""
    if args.pp is not None and args.pp > 1:
        if _given(argv, "--strategy") and args.strategy != "pipeline":
            return f"--pp cuts the model into a pipeline; it is not for --strategy {args.strategy}"
        if args.stages is not None and args.stages != args.pp:
            return f"--pp {args.pp} and --stages {args.stages} disagree; give one of them"
        args.strategy, args.stages = "pipeline", args.pp
    if args.dp is not None or _given(argv, "--pp", "--tp"):
        stages = (args.stages or 2) if args.strategy == "pipeline" else 1
        n = (args.dp or 1) * stages * args.tp
        if not _given(argv, "--workers", "-n"):
            args.workers = n
        elif args.dp is not None and args.workers != n:
            return (f"--workers {args.workers}, but --dp x --pp x --tp = {args.dp} x {stages} x {args.tp} = {n}; "
                    "give one or the other")
    return None
