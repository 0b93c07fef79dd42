"""How fast is paratrain's DataParallel beside PyTorch's DistributedDataParallel?

    paratrain bench data-parallel [--models small,large] [--workers 1,2,4] [--quick]
    python benchmarks/data_parallel.py            (the same)

For each model (small: MLP 784-512-512-10, 0.7M parameters; large:
784-3072-3072-3072-10, 21M parameters, communication-heavy), batch 32 per
worker, one thread per worker, SGD:

- one worker alone (``single``): the baseline of scaling efficiency,
  throughput with N workers / (N x one worker's);
- with N workers, in the same processes, interleaved round by round (dp_worker.py):
  paratrain's DataParallel (default algorithm, ring, and the master-based naive
  scheme) and DDP over Gloo.

Prints samples/s, the ratio to DDP and the scaling efficiency, and writes
benchmarks/results/data_parallel.json and data_parallel.png.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from ..train.argtypes import positive_float, positive_int
from . import launcher

MODELS = {"small": [784, 512, 512, 10], "large": [784, 3072, 3072, 3072, 10]}
QUICK_MODELS = {"small": [64, 128, 10], "large": [64, 512, 512, 10]}
ENGINES = ["paratrain", "ddp", "paratrain+overlap", "paratrain/ring", "paratrain/naive",
           "compute-only", "allreduce-only"]
PHASES = ("forward", "backward", "averaging", "optimizer")
OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def parser():
    p = argparse.ArgumentParser(prog="paratrain bench data-parallel",
                                description="paratrain DataParallel vs PyTorch DDP (Gloo), same run, same model")
    p.add_argument("--models", default="small,large", help="small, large (default both)")
    p.add_argument("--workers", default="1,2,4", help="worker counts (1 = the single-process baseline)")
    p.add_argument("--batch", type=positive_int, default=32, help="samples per worker per step (default 32)")
    p.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="steps per engine per round (default: 3 large, 20 small)")
    p.add_argument("--engines", default=",".join(ENGINES), help="engines with several workers")
    p.add_argument("--quick", action="store_true", help="tiny models and few rounds (a smoke test)")
    p.add_argument("--out", default=str(OUT), help="folder for the JSON and PNG")
    p.add_argument("--timeout", type=positive_float, default=1800, help="seconds before a run is stopped")
    return p


def run_one(model, sizes, nproc, engines, args, tmp):
    steps = args.steps or (3 if model == "large" else 20)
    cfg = dict(sizes=sizes, engines=engines, batch=args.batch, rounds=args.rounds, steps=steps,
               warmup=2, timeout=args.timeout, result=str(Path(tmp) / f"{model}-{nproc}.json"))
    print(f"[bench] {model} model, {nproc} worker(s): {', '.join(engines)}", file=sys.stderr, flush=True)
    return launcher.run_config(nproc, "paratrain.bench.dp_worker", cfg, args.timeout, tmp, f"{model}/{nproc}-worker")


def summarize(raw, batch):
    """rows: one per (model, workers, engine) with the median step time and samples/s,
    the ratio to DDP in the same run, the scaling efficiency against one worker, and
    the median time of each phase of a step on rank 0 (ms)."""
    rows = []
    for (model, n), result in raw.items():
        for engine, times in result["times"].items():
            step = statistics.median(times)
            phases = {f"{p}_ms": statistics.median(v) * 1e3 for p, v in result["phases"][engine].items()}
            rows.append(dict(model=model, workers=n, engine=engine, step_ms=step * 1e3,
                             samples_per_s=batch * n / step, rounds=len(times), **phases))
    by = {(r["model"], r["workers"], r["engine"]): r for r in rows}
    for r in rows:
        ddp = by.get((r["model"], r["workers"], "ddp"))
        one = by.get((r["model"], 1, "single"))
        r["vs_ddp"] = r["samples_per_s"] / ddp["samples_per_s"] if ddp else None
        r["efficiency"] = r["samples_per_s"] / (r["workers"] * one["samples_per_s"]) if one else None
        r["vs_single"] = r["samples_per_s"] / one["samples_per_s"] if one else None
    return rows


def table(rows):
    from rich.table import Table
    t = Table(title="DataParallel vs DDP (Gloo): samples/s, medians of interleaved rounds")
    for c in ("model", "workers", "engine", "step ms", "samples/s", "vs DDP", "vs 1 worker", "efficiency"):
        t.add_column(c, justify="left" if c in ("model", "engine") else "right")
    for r in rows:
        if r["engine"] == "allreduce-only":
            continue   # not a training step: it is in the phase table only
        f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
        t.add_row(r["model"], str(r["workers"]), r["engine"], f"{r['step_ms']:.1f}", f"{r['samples_per_s']:.0f}",
                  f(r["vs_ddp"], "{:.2f}x"), f(r["vs_single"], "{:.2f}x"), f(r["efficiency"], "{:.0%}"))
    return t


def phase_table(rows):
    """Where a step's time goes, per engine: the question 'compute slowed by sharing the
    machine, the all-reduce itself, or waiting?' answered by compute-only (no averaging,
    all workers at once) and allreduce-only (the collective alone) beside the engines."""
    from rich.table import Table
    t = Table(title="Where a step goes (ms, medians; rank 0's phases, the step is the slowest rank's)")
    for c in ("model", "workers", "engine", *PHASES, "step"):
        t.add_column(c, justify="left" if c in ("model", "engine") else "right")
    for r in rows:
        t.add_row(r["model"], str(r["workers"]), r["engine"], *(f"{r[p + '_ms']:.1f}" for p in PHASES),
                  f"{r['step_ms']:.1f}")
    return t


def plot(path, rows):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    models = sorted({r["model"] for r in rows}, key=list(MODELS).index)
    fig = Figure(figsize=(6 * len(models), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, m in zip(fig.subplots(1, len(models), squeeze=False)[0], models):
        mine = [r for r in rows if r["model"] == m]
        engines = sorted({r["engine"] for r in mine if r["workers"] > 1 and r["engine"] != "allreduce-only"})
        workers = sorted({r["workers"] for r in mine if r["workers"] > 1})
        width = 0.8 / max(1, len(engines))
        for i, e in enumerate(engines):
            ys = [next((r["samples_per_s"] for r in mine if r["workers"] == n and r["engine"] == e), 0)
                  for n in workers]
            ax.bar([w + (i - (len(engines) - 1) / 2) * width for w in range(len(workers))], ys, width, label=e)
        one = next((r["samples_per_s"] for r in mine if r["engine"] == "single"), None)
        if one:
            ax.axhline(one, color="black", linestyle="--", linewidth=1, label="1 worker alone")
        ax.set_xticks(range(len(workers)), [f"{n} workers" for n in workers])
        ax.set_ylabel("samples/s")
        ax.set_title(f"{m} MLP {'-'.join(map(str, MODELS[m]))}")
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    args = parser().parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, args.steps or 2
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            print(f"paratrain bench data-parallel: unknown model {m!r}; choose from {', '.join(MODELS)}",
                  file=sys.stderr)
            return 2
    workers = sorted({int(w) for w in args.workers.split(",")})
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    raw = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            sizes = (QUICK_MODELS if args.quick else MODELS)[m]
            for n in workers:
                raw[(m, n)] = run_one(m, sizes, n, ["single"] if n == 1 else engines, args, tmp)
    rows = summarize(raw, args.batch)
    from rich.console import Console
    console = Console()
    if not console.is_terminal:
        console = Console(width=130)
    console.print(table(rows))
    console.print(phase_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(batch_per_worker=args.batch, rounds=args.rounds, cpu_count=os.cpu_count(),
                models={m: (QUICK_MODELS if args.quick else MODELS)[m] for m in models}, quick=args.quick)
    (out / "data_parallel.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    png = plot(out / "data_parallel.png", rows)
    print(f"wrote {out / 'data_parallel.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
