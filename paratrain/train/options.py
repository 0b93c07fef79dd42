"""The options of ``paratrain train``, shared by the front-end (which checks them
before starting anything) and the workers (which receive the same words).

The general options are here; those every strategy shares have a module each
(layout.py: --dp/--pp/--tp/--sequence-parallel; compression.py; optimizer.py),
and each strategy adds its own (strategies/, one argument group each);
--strategy offers the names in strategies.STRATEGIES."""
import argparse

from ..launch import binding
from . import compression, elastic_options, layout, optimizer, strategies
from .argtypes import positive_float, positive_int
from .fail import fail_spec
from .slowdown import jitter_spec, straggler_spec
from .tasks import TASKS


def build_parser():
    p = argparse.ArgumentParser(
        prog="paratrain train", allow_abbrev=False,
        description=f"Train a built-in model on several local worker processes, with any of the strategies "
                    f"({', '.join(strategies.STRATEGIES)}). With no arguments: the digits classifier on 2 workers.")
    p.add_argument("--model", default="digits", choices=TASKS,
                   help="built-in task: digits (CNN on scikit-learn's digits), gpt (character-level GPT on "
                        "the Python standard library's source), mlp / mlp-large (benchmark MLPs on synthetic data), "
                        "recsys (click prediction with a large embedding table), hf-gpt2 / hf-llama / hf-bert "
                        "(small Hugging Face models on the same text as gpt; needs pip install -e '.[hf]')")
    p.add_argument("--workers", "-n", type=positive_int, default=2, help="worker processes (default 2)")
    p.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (default: the task's)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="samples per worker per step")
    p.add_argument("--lr", type=positive_float, default=None, help="learning rate (default: the task's)")
    optimizer.add_options(p)
    p.add_argument("--strategy", choices=list(strategies.STRATEGIES), default=strategies.DEFAULT,
                   help="; ".join(module.HELP for module in strategies.modules()))
    compression.add_options(p)
    p.add_argument("--straggler", type=straggler_spec, default=None, metavar="RANK:FACTOR",
                   help="make worker RANK compute FACTOR times slower on every step (a persistently slow "
                        "machine): it sleeps (FACTOR - 1) x its measured forward+backward time")
    p.add_argument("--jitter", type=jitter_spec, default=None, metavar="P:FACTOR",
                   help="on each step, each worker computes FACTOR times slower with probability P (transient "
                        "hiccups), drawn from a generator seeded by --seed and the rank")
    p.add_argument("--fail", type=fail_spec, action="append", default=[], metavar="RANK:STEP",
                   help="kill worker RANK with SIGKILL as it begins step STEP, to see what the job does with a "
                        "lost worker (repeat for more; elastic: RANK:STEP:commit or RANK:STEP:reform die in a "
                        "commit or a re-form)")
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
    p.add_argument("--trace", action="store_true",
                   help="record a timeline of every rank: runs/<id>/trace.json (Perfetto, chrome://tracing), "
                        "trace.png, and where each rank's step time went (`paratrain trace runs/<id>`)")
    p.add_argument("--tensorboard", action="store_true",
                   help="write the loss, evaluation, samples/s, communication and each rank's step time to "
                        "runs/<id>/tb/ for TensorBoard (needs the tensorboard extra)")
    p.add_argument("--stall-s", type=positive_float, default=None, metavar="S",
                   help="seconds a worker waits in a call before it logs which ranks it waits for and their "
                        "stacks (default 60)")
    p.add_argument("--trace-every-other", action="store_true", help=argparse.SUPPRESS)  # bench trace: A/B steps
    p.add_argument("--budget", type=positive_float, default=None, help=argparse.SUPPRESS)  # compare: seconds
    p.add_argument("--runs", default="runs", help="folder for run directories (default ./runs)")
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)  # set by the front-end for the workers
    layout.add_options(p)
    elastic_options.add_options(p)
    for module in strategies.modules():   # each strategy's own flags, in a group of its own after these
        module.add_options(p)
    return p


def check(args):
    """A message for what is wrong in the options, or None: the chosen strategy
    first, then the options every strategy shares, then the other strategies."""
    return strategies.check(args, shared=(compression.check, layout.check, elastic_options.check))

