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

from .options import build_parser


def new_run_dir(root, model):
    base = os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-{model}")
    path, i = base, 1
    while os.path.exists(path):
        i += 1
        path = f"{base}-{i}"
    os.makedirs(path)
    return path


def worker_failure(args):
    """Launcher options for a worker that dies. Under ASP and SSP no worker waits for
    another, so the others go on and take its share of the batches (coordination.py);
    under BSP and all-reduce they would block on it, so the launcher stops the job.
    Passed only when this launcher knows the option (it came with the launcher's
    parameter-server support). Rank 0 is the exception: it hosts the job's store
    and writes the summary, so when it dies the job cannot continue."""
    if args.strategy != "ps" or args.consistency == "bsp":
        return []
    from ..launch.local import build_parser
    if "--worker-failure" not in build_parser().format_help():
        return []
    return ["--worker-failure", "continue"]


def check(args):
    """A message for what is wrong with the options, or None."""
    if args.strategy == "ps" and args.resume:
        return "--resume with --strategy ps is not available yet (the optimizer state lives on the servers)"
    if args.consistency == "ssp" and (args.staleness is None or args.staleness < 0):
        return "--consistency ssp needs --staleness N (N >= 0; 0 behaves like bsp, inf like asp)"
    if args.strategy != "ps" and (args.consistency != "bsp" or args.staleness is not None):
        return "--consistency and --staleness are for --strategy ps"
    if getattr(args, "predict_weights", False) and (args.strategy != "ps" or args.consistency == "bsp"
                                 or (args.consistency == "ssp" and args.staleness == 0)):
        return "--predict-weights is for --strategy ps with --consistency asp or ssp (staleness > 0)"
    if args.straggler and args.straggler[0] >= args.workers:
        return (f"--straggler {args.straggler[0]}:{args.straggler[1]:g}: there is no rank {args.straggler[0]} "
                f"among {args.workers} workers (ranks 0..{args.workers - 1})")
    if args.resume:
        from .checkpoint import load_checkpoint
        from .tasks import build_task
        try:
            load_checkpoint(args.resume, expect_config=build_task(args.model, seed=args.seed, sparse=args.strategy == "ps").config)
        except (FileNotFoundError, ValueError) as e:
            return str(e)
    if args.algorithm and args.strategy == "allreduce" and args.algorithm not in ("direct", "ring", "tree", "naive"):
        return f"unknown --algorithm {args.algorithm!r}; choose direct, ring, tree or naive"
    return None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a bad flag: argparse said why
        return e.code if isinstance(e.code, int) else 2
    problem = check(args)
    if problem:
        print(f"paratrain train: error: {problem}", file=sys.stderr)
        return 2
    run_dir = new_run_dir(args.runs, args.model)
    from ..launch.local import main as launch
    from .metrics import render_summary
    from .progress import ProgressDisplay
    servers = ["--servers", str(args.servers)] if args.strategy == "ps" else []
    launcher = ["-n", str(args.workers), "--threads", str(args.threads), "--bind-to", args.bind_to,
                *servers, *worker_failure(args),
                "-m", "paratrain.train.worker", *argv, "--run-dir", run_dir]
    print(f"paratrain train: {args.model} on {args.workers} workers ({args.strategy}), run dir {run_dir}",
          flush=True)
    with ProgressDisplay(f"{args.model} x{args.workers}") as display:
        rc = launch(launcher, on_line=display.on_line)
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
    return 0
