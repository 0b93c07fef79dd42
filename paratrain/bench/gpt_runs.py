"""What the GPT benchmarks' front-ends share (pipeline.py, tensor.py, zero.py).

Each times the same model (the gpt task made bigger) under several engines
in worker processes (their workers: rounds.serve_gpt), then prints a table and
writes JSON and a plot. The options every one takes, the run of one set of
workers, and the printing and writing are here.
"""
import json
import os
import statistics
import sys
from pathlib import Path

from ..train.argtypes import positive_float, positive_int
from . import launcher

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def add_common_options(p):
    p.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=positive_int, default=2, help="steps per engine per round (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each engine before the rounds (default 2)")
    p.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds (a smoke test)")
    p.add_argument("--out", default=str(OUT), help="folder for the JSON and PNG")
    p.add_argument("--timeout", type=positive_float, default=1800, help="seconds before a run is stopped")


def words(text):
    """The items of a comma-separated option ("a, b,,c" -> ["a", "b", "c"])."""
    return [w.strip() for w in text.split(",") if w.strip()]


def model_of(args, model, quick):
    """The model's sizes; --quick: the tiny one, 2 rounds of 1 step."""
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 1, 1
    return dict(quick if args.quick else model)


def run_workers(nproc, module, engines, model, args, folder):
    """``nproc`` workers of ``module`` timing ``engines`` (after ``--warmup`` untimed steps
    each); their rank 0's result."""
    name = module.rsplit(".", 1)[-1]
    cfg = dict(model, engines=engines, rounds=args.rounds, steps=args.steps, warmup=args.warmup, timeout=args.timeout,
               result=str(Path(folder) / f"{name}-{nproc}.json"))
    print(f"[bench] {nproc} worker(s): {', '.join(engines)}", file=sys.stderr, flush=True)
    return launcher.run_config(nproc, module, cfg, args.timeout, folder, f"{name}-{nproc}")


# Above this median spread of an engine's rounds, a run cannot judge a target of a few
# percent: the threshold sits between a quiet machine's spread and a busy host's.
BUSY_SPREAD = 0.10


def round_spreads(times):
    """{engine: (slowest round - fastest round) / median round}: how steady the machine
    was while the engine ran."""
    return {e: (max(t) - min(t)) / statistics.median(t) for e, t in times.items() if len(t) > 1}


def steadiness(times):
    """One line on how steady the rounds were, and a warning when the machine was busy."""
    spreads = round_spreads(times)
    if not spreads:
        return None
    worst = max(spreads, key=spreads.get)
    median = statistics.median(spreads.values())
    line = (f"rounds' spread, (slowest - fastest) / median: {median:.0%} over engines (median), "
            f"at worst {spreads[worst]:.0%} ({worst})")
    if median > BUSY_SPREAD:
        line += (f"; above {BUSY_SPREAD:.0%}: the machine was busy during this run, and its ratios cannot "
                 "judge a target of a few percent; run it again on a quiet machine")
    return line


def show_and_save(table, name, model, args, rows, raw, width=160, times=None, **meta):
    """Print ``table`` and, given each engine's round ``times``, how steady they were;
    write ``<out>/<name>.json`` (the model, the run's settings, the rows, the rounds'
    spread and the workers' raw results); returns the output folder."""
    from rich.console import Console
    console = Console()
    if not console.is_terminal:
        console = Console(width=width)
    console.print(table)
    steady = steadiness(times or {})
    if steady:
        print(steady)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(model, rounds=args.rounds, steps=args.steps, warmup=args.warmup, cpu_count=os.cpu_count(),
                    quick=args.quick, round_spread=round_spreads(times or {}), **meta)
    (out / f"{name}.json").write_text(json.dumps(dict(settings, rows=rows, raw=raw), indent=1))
    return out
