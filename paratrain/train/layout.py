"""The layout of a job's workers, ``--dp``, ``--pp``, ``--tp`` and ``--sequence-parallel``,
for every strategy: torchtitan's ParallelDims, in paratrain train's words.

A job is dp replicas of a pipeline of pp stages, each stage cut across tp
workers (pt.mesh's names and order; parallel/mesh.py builds the groups).
Which strategy cuts along which of them is the strategy's to declare (CUTS
in its module: "pp", "tp"), and the strategy table answers who does
(strategies.cutting), so the layout names no strategy: ``--pp N`` (N > 1) is
the one strategy that cuts "pp", with N stages, and ``--tp`` is refused for a
strategy that does not cut "tp". ``--sequence-parallel`` goes with --tp; a
strategy that cuts layers but not their tokens refuses it in its own check.
"""
from dataclasses import dataclass

import paratrain as pt

from . import strategies
from .argtypes import positive_int
from .tasks import build_task


@dataclass(frozen=True)
class Layout:
    """dp x pp x tp workers (as torchtitan's ParallelDims): data-parallel replicas,
    pipeline stages, tensor-parallel workers per stage."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def world_size(self):
        return self.dp * self.pp * self.tp

    def __str__(self):
        return f"--dp x --pp x --tp = {self.dp} x {self.pp} x {self.tp} = {self.world_size}"


def _pipeline():
    """(name, module) of the strategy that cuts the model into pipeline stages, or None."""
    names = strategies.cutting("pp")
    return (names[0], strategies.STRATEGIES[names[0]]) if names else None


def add_options(parser):
    pipeline = _pipeline()
    pp = pipeline[0] if pipeline else None
    g = parser.add_argument_group("layout (every strategy: dp x pp x tp workers, as pt.mesh)")
    g.add_argument("--dp", type=positive_int, default=None,
                   help="data-parallel replicas: sets --workers to dp x pp x tp")
    g.add_argument("--pp", type=positive_int, default=None,
                   help=f"pipeline stages: --strategy {pp} --stages PP" if pp else "pipeline stages")
    g.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel size: each model cut across this many workers (gpt and the hf-* "
                        "tasks; default 1); --workers / --tp replicas average their gradients"
                        + (f"; with --strategy {pp}, each stage cut so (3D)" if pp in strategies.cutting("tp")
                           else ""))
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: LayerNorms and residuals on 1/tp of the tokens each (Korthikanti et al.)")


def _given(argv, *flags):
    return any(a in flags or a.startswith(tuple(f + "=" for f in flags)) for a in argv)


def resolve(args, argv):
    """The mesh's names, ``--dp``, ``--pp`` and ``--tp`` (as pt.mesh), into what the
    strategies read: ``--pp N`` (N > 1) is the pipeline strategy with N stages, and
    ``--dp D`` makes ``--workers`` D x pp x tp (D = 1 when only --pp or --tp is
    given and --workers is not). Run on the front-end and on every worker (which
    get the same words). Returns what is wrong, or None."""
    pipeline = _pipeline()
    if args.pp is not None and args.pp > 1:
        if pipeline is None:
            return "--pp: no strategy here cuts the model into a pipeline"
        name, module = pipeline
        if _given(argv, "--strategy") and args.strategy != name:
            return f"--pp cuts the model into a pipeline; it is not for --strategy {args.strategy}"
        problem = module.take_pp(args, args.pp)
        if problem:
            return problem
        args.strategy = name
    if args.dp is not None or _given(argv, "--pp", "--tp"):
        cuts_pp = pipeline is not None and args.strategy == pipeline[0]
        layout = Layout(dp=args.dp or 1, pp=pipeline[1].stages(args) if cuts_pp else 1, tp=args.tp)
        if not _given(argv, "--workers", "-n"):
            args.workers = layout.world_size
        elif args.dp is not None and args.workers != layout.world_size:
            return f"--workers {args.workers}, but {layout}; give one or the other"
    return None


def check(args):
    """What is wrong with --tp and --sequence-parallel for the chosen strategy, or None
    (run after the chosen strategy's own check: strategies.check)."""
    if args.tp > 1:   # a strategy that cuts "pp" too checks its own multiple (stages x tp)
        if args.strategy not in strategies.cutting("tp"):
            return f"--tp is for --strategy {' or '.join(strategies.cutting('tp'))}"
        if args.workers % args.tp:
            return f"--workers {args.workers} is not a multiple of --tp {args.tp}"
        task = build_task(args.model, seed=args.seed)
        if task.tensor_plan is None:
            return (f"--tp cuts a transformer (gpt, hf-gpt2, hf-bert, hf-llama: each has a tensor-parallel plan), "
                    f"not {args.model}")
        try:   # widths, vocabulary and heads --tp must divide, before any worker starts
            pt.tensor.check_plan(task.model, task.tensor_plan(task.model), args.tp)
        except ValueError as e:
            return f"--tp {args.tp}: {e}"
    elif args.sequence_parallel:
        return "--sequence-parallel cuts the tokens among tensor-parallel workers; give --tp 2 or more"
    return None
