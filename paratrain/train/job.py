"""``paratrain train``: the main job, as a user starts it.

This process is the front-end: it checks the options before anything starts,
makes the run directory, starts the workers through the launcher (one
``python -m paratrain.train.worker`` per rank), draws rank 0's progress as a
bar on this terminal (the workers' own output is piped, so they cannot), and
prints the summary table that rank 0 left in ``runs/<id>/summary.json``.
"""
import json
import os
import sys
import time

from .. import config


def new_run_dir(root, model):
    base = os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-{model}")
    path, i = base, 1
    while os.path.exists(path):
        i += 1
        path = f"{base}-{i}"
    os.makedirs(path)
    return path


def check(args):
    """A message for what is wrong with the options, or None."""
    from . import options
    problem = options.check(args)
    if problem:
        return problem
    if args.tensorboard:
        from .tensorboard import missing
        problem = missing()
        if problem:
            return problem
    if args.straggler and args.straggler[0] >= args.workers:
        return (f"--straggler {args.straggler[0]}:{args.straggler[1]:g}: there is no rank {args.straggler[0]} "
                f"among {args.workers} workers (ranks 0..{args.workers - 1})")
    if args.resume:
        from .checkpoint import load_checkpoint
        from .tasks import build_task
        try:
            from . import elastic_options, strategies
            task = build_task(args.model, seed=args.seed, sparse=strategies.STRATEGIES[args.strategy].SPARSE)
            return elastic_options.resume_problem(args, load_checkpoint(args.resume, expect_config=task.config))
        except (FileNotFoundError, ValueError) as e:
            return str(e)
    return None


def warm_start(argv):
    """A fork server for this job's workers and servers, started before the front-end imports
    torch itself (launch/warm.py), or None: when one is set already (PARATRAIN_FORKSERVER),
    PARATRAIN_WARM_START=0, or only --help was asked for."""
    if config.get("PARATRAIN_FORKSERVER") or not config.get("PARATRAIN_WARM_START") or \
            any(a in ("-h", "--help") for a in argv):
        return None
    import argparse
    threads = argparse.ArgumentParser(add_help=False)
    threads.add_argument("--threads", type=int, default=1)
    try:
        known, _ = threads.parse_known_args(argv)
    except SystemExit:   # (a bad --threads: the real parser says so below)
        return None
    from ..launch.forkserver import TRAINING_PRELOAD
    from ..launch.warm import WarmStart
    return WarmStart(os.environ, preload=TRAINING_PRELOAD, threads=known.threads)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    warm = warm_start(argv)
    try:
        return _main(argv, warm)
    finally:
        if warm is not None:
            warm.stop()


WARM_WAIT_S = 60.0   # the longest the workers' start waits for the fork server to import torch


def _main(argv, warm):
    from . import elastic_options, layout, options, strategies
    parser = options.build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a bad flag: argparse said why
        return e.code if isinstance(e.code, int) else 2
    problem = layout.resolve(args, argv) or check(args)
    if problem:
        print(f"paratrain train: error: {problem}", file=sys.stderr)
        return 2
    run_dir = new_run_dir(args.runs, args.model)
    from ..launch.local import main as launch
    from .metrics import render_summary
    from .progress import ProgressDisplay
    tracing = ["--trace", os.path.join(run_dir, "trace"), "--trace-out", os.path.join(run_dir, "trace.json")] \
        if args.trace else []
    tracing += ["--stall-s", repr(args.stall_s)] if args.stall_s else []
    if not config.get("PARATRAIN_FLIGHT_DIR"):
        tracing += ["--flight-dir", os.path.join(os.path.abspath(run_dir), "flight")]
    launcher = ["-n", str(args.workers), "--threads", str(args.threads), "--bind-to", args.bind_to, *tracing,
                *strategies.STRATEGIES[args.strategy].launcher_args(args), *elastic_options.launcher_args(args),
                "-m", "paratrain.train.worker", *argv, "--run-dir", run_dir]
    print(f"paratrain train: {args.model} on {args.workers} workers ({args.strategy}), run dir {run_dir}",
          flush=True)
    forked = warm is not None and warm.ready(timeout=WARM_WAIT_S)   # else they start fresh
    if forked:
        os.environ["PARATRAIN_FORKSERVER"] = warm.address
    try:
        with ProgressDisplay(f"{args.model} x{args.workers}") as display:
            rc = launch(launcher, on_line=display.on_line)
    finally:
        if forked:
            os.environ.pop("PARATRAIN_FORKSERVER", None)
    if rc != 0:
        return rc
    from rich.console import Console
    console = Console()
    if not console.is_terminal:  # a log or a pipe: do not fold paths at 80 columns
        console = Console(width=120)
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    except FileNotFoundError:
        print(f"paratrain train: error: the job ended without {run_dir}/summary.json: rank 0 writes it, and "
              "rank 0 also hosts the job's store, so a job cannot finish without it", file=sys.stderr)
        return 1
    render_summary(summary, console)
    if args.trace:
        show_trace(run_dir, console)
    return 0


def show_trace(run_dir, console):
    """After a traced run: trace.png, and where each rank's step time went."""
    from ..trace import command
    try:
        result = command.analyse_and_plot(run_dir)
    except (OSError, ValueError) as e:
        console.print(f"paratrain train: the trace could not be read: {e}")
        return
    console.print("\n".join(command.report(result)), highlight=False, markup=False)
