"""``paratrain compare``: train one model under every strategy for the same budget, and compare.

    paratrain compare --model gpt --workers 2                  every strategy, 30 s each
    paratrain compare --model digits --strategies dp,zero3,topk --steps 50 --target-loss 0.3

Each strategy runs as an ordinary ``paratrain train`` run (its folder, its
summary, its trace with --trace) under ``runs/compare-<id>/``, one after
another, the same model, data, seed and batch for all (``--rounds N``: the
whole list N times, every other round in reverse, and each strategy's median
run shown: a shared host drifts by more than strategies differ, and runs one
after another would rank the minutes they ran in); then compare.md (the
table), compare.json ({"rows": [...]}) and compare.png (loss against wall
time; memory and bytes per step) are written beside them. A strategy that
cannot run with these workers or this model is listed with train's reason.
"""
import argparse
import os
import sys
import time

from ..train.argtypes import positive_float, positive_int
from . import report
from .runs import one_fork_server, run_one
from .strategies import NAMES, parse_names, why_not

DEFAULT_BUDGET_S = 30.0
def budget_seconds(text):
    """--budget: seconds, as 90, 90s or 1.5m."""
    t = text.strip().lower()
    scale = 60.0 if t.endswith("m") else 1.0
    try:
        value = float(t.rstrip("sm")) * scale
    except ValueError:
        value = -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--budget {text!r}: give seconds, e.g. 120s or 2m")
    return value


def round_order(names, r):
    """The strategies in round ``r`` (from 0): as given in even rounds, reversed in odd ones, so
    that over two rounds every strategy sits as early on average as every other and a host's
    steady drift favours none of them."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def build_parser():
    p = argparse.ArgumentParser(prog="paratrain compare", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="digits", help="the built-in model every strategy trains (default digits)")
    p.add_argument("--workers", "-n", type=positive_int, default=2, help="workers for each strategy (default 2)")
    p.add_argument("--strategies", default="all",
                   help=f"comma-separated, from {', '.join(NAMES)}, or combinations of dp, pp and tp "
                        f"(dp2-pp2, pp2-tp2, ...); or all (the default: every name and the combinations "
                        f"--workers allows)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--budget", type=budget_seconds, default=None,
                      help=f"wall-clock seconds of training for each strategy, e.g. 120s (default "
                           f"{DEFAULT_BUDGET_S:g}s)")
    when.add_argument("--steps", type=positive_int, default=None, help="the same optimizer steps for each, instead")
    p.add_argument("--rounds", type=positive_int, default=1, metavar="N",
                   help="run every strategy N times, in alternating order, and show each one's median run "
                        "(default 1): on a shared host the speed drifts by more than strategies differ")
    p.add_argument("--target-loss", type=positive_float, default=None, metavar="X",
                   help="also report each strategy's time until its loss first reached X")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="samples per worker per step (default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true", help="trace every run (paratrain trace on its folder)")
    p.add_argument("--runs", default="runs", help="where compare-<id>/ goes (default ./runs)")
    return p


def common_flags(args, folder):
    flags = ["--model", args.model, "--workers", str(args.workers), "--runs", folder, "--seed", str(args.seed)]
    flags += ["--steps", str(args.steps)] if args.steps else ["--budget", repr(args.budget or DEFAULT_BUDGET_S)]
    if args.target_loss:
        flags += ["--target-loss", repr(args.target_loss)]
    if args.batch_size:
        flags += ["--batch-size", str(args.batch_size)]
    return flags + (["--trace"] if args.trace else [])


def predictor(args):
    """A function of a strategy's name to its ``predicted_step_ms`` from simulate's model of
    this machine, or None when ``paratrain simulate --calibrate`` has stored no links.
    Each prediction times the model afresh, just before the strategy runs and again just
    after, and takes the mean: this machine's speed moves by a third within minutes
    (shared hosts; the same dp prediction timed six times in 20 s: 165-203 ms), and a
    prediction timed in another minute than its run would compare the minutes, not the
    model."""
    from ..simulate import here, plan, timing
    from ..simulate.command import calibration_path
    if not os.path.exists(calibration_path()):
        return None
    try:
        cluster = here.cluster_here(calibration_path())
    except ValueError as e:
        print(f"paratrain compare: no predictions: {e}")
        return None

    def predict(name, compute=None, slowest=1.0, mean=1.0):
        """name's Step timed afresh; or, given the run's ``compute`` (a timing.Timed of rank 0's),
        (Step, speed, pace, worth) at the run's speed (plan.predict_from_run), on the last
        timings, where pace is the model's whole step at that speed (plan.host_pace x speed)
        and worth plan.whole_steps_per_compute."""
        if compute is not None:
            step, speed = plan.predict_from_run(args.model, args.workers, name, cluster, compute, args.batch_size,
                                                slowest, mean)
            pace = speed * plan.host_pace(args.model, args.workers, cluster, args.batch_size)
            return step, speed, pace, plan.whole_steps_per_compute(args.model, args.workers, name, cluster,
                                                                   args.batch_size)
        timing.forget_timings()
        steps = plan.predict_compare(args.model, args.workers, [name], cluster, args.batch_size)
        return steps.get(name)
    return predict


def from_run_fields(predict, name, row):
    """``predicted_from_run_compute_ms``: the row's strategy predicted at the speed its run
    computed at (and as unsteadily); ``run_compute_speed``, that speed against the
    timing's (the run's compute a step over the model's: 1.2, the run computed 20% slower);
    ``pace_ms``, the model's whole step at that speed: how fast this host computed during the
    run, in the same units for every strategy; and ``whole_steps_per_compute``, the ratio
    that converted the run's compute into them (report.at_one_pace)."""
    from ..simulate.timing import Timed
    if not row.get("compute_ms"):
        return {}
    step, speed, pace, worth = predict(name, Timed.of(row["compute_ms"] / 1e3, row["compute_jitter_ms"] / 1e3),
                                       row.get("slowest_compute_ratio", 1.0), row.get("mean_compute_ratio", 1.0))
    return {"predicted_from_run_compute_ms": 1e3 * step.step_s, "run_compute_speed": speed,
            "pace_ms": 1e3 * pace, "whole_steps_per_compute": worth} if step else {}


def prediction_fields(before, after):
    """A row's prediction from its two timings (Steps; ``after`` None if it failed):
    ``predicted_step_ms``, their mean; ``predicted_before_after_ms``, the two; and
    ``predicted_parts_ms``, the mean's parts (compute, compression's or the servers' extra
    compute, exposed communication, bubble, waiting for the slowest)."""
    timed = [s for s in (before, after) if s is not None]
    fields = {"predicted_step_ms": 1e3 * sum(s.step_s for s in timed) / len(timed),
              "predicted_parts_ms": {p: 1e3 * sum(s.parts[p] for s in timed) / len(timed) for p in timed[0].PARTS}}
    if len(timed) == 2:   # how far this host's speed moved across the run
        fields["predicted_before_after_ms"] = [1e3 * before.step_s, 1e3 * after.step_s]
    return fields


def run_and_predict(name, flags, folder, predict, log, say):
    """One run of ``name`` (logs/<log>.log) and its row, with the model's prediction timed just
    before it and just after (the two bracket the run), and at the run's own speed; ``say``
    is told what it is doing."""
    say(f"predicting {log}")
    predicted = predict(name) if predict else None
    say(f"training {log}")
    row = run_one(name, flags, folder, log=log)
    if predicted and "unavailable" not in row:
        say(f"predicting {log} again")
        row.update(prediction_fields(predicted, predict(name)))
        row.update(from_run_fields(predict, name, row))
    return row


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        names = parse_names(args.strategies, args.workers)
    except ValueError as e:
        print(f"paratrain compare: error: {e}", file=sys.stderr)
        return 2
    folder = os.path.join(args.runs, f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(os.path.join(folder, "logs"), exist_ok=True)
    flags = common_flags(args, folder)
    how_long = f"{args.steps} steps" if args.steps else f"{args.budget or DEFAULT_BUDGET_S:g} s"
    title = f"{args.model} on {args.workers} workers, {how_long} each"
    print(f"paratrain compare: {title}; runs in {folder}", flush=True)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    runs, predict = {name: [] for name in names}, predictor(args)
    unavailable = {name: why_not(name, flags) for name in names}
    with one_fork_server(), Progress(TextColumn("{task.description}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn()) as bar:
        task = bar.add_task("compare", total=len(names) * args.rounds)
        for r in range(args.rounds):
            for name in round_order(names, r):
                if not unavailable[name]:
                    log = f"{name}.{r + 1}" if args.rounds > 1 else name
                    row = run_and_predict(name, flags, folder, predict, log,
                                          lambda text: bar.update(task, description=text))
                    runs[name].append(row)
                    bar.console.print(f"{log}: " + (row["unavailable"] if "unavailable" in row else
                                      f"{row['samples_per_s']:,.0f} samples/s, loss {row['loss']:.4f}"))
                bar.advance(task)
    report.at_one_pace([run for name in names for run in runs[name]])
    rows = [{"strategy": name, "unavailable": unavailable[name]} if unavailable[name]
            else report.median_run(runs[name]) for name in names]
    paths = report.write(folder, rows, title)
    print(report.markdown(rows, title))
    print("wrote " + ", ".join(paths))
    return 0 if any("unavailable" not in r for r in rows) else 1
