"""``paratrain plan``: the layouts the workers allow, predicted, ranked, and the command for each.

    paratrain plan --model gpt --workers 2 [--cluster here|CLUSTER.toml] [--memory-gb M] [--verify] [--json]

plan.py enumerates and ranks the layouts; here they are printed (a table, or
``{"layouts": [...]}`` with ``--json``), and ``--verify`` runs the first
three here as ``paratrain compare`` runs a strategy and prints predicted
against measured.
"""
import argparse
import json
import sys

from ..train.argtypes import positive_float, positive_int
from . import here
from .plan import rank, row


def build_parser():
    from .command import calibration_path
    p = argparse.ArgumentParser(prog="paratrain plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", help="the built-in model (default gpt)")
    p.add_argument("--workers", "-n", type=positive_int, default=2, help="workers (default 2)")
    p.add_argument("--cluster", default="here", help="here (this machine, calibrated; default) or a CLUSTER.toml")
    p.add_argument("--calibration", default=None, help=f"the calibration --cluster here reads "
                                                        f"(default {calibration_path()})")
    p.add_argument("--memory-gb", type=positive_float, default=None,
                   help="drop layouts predicted to hold more a worker")
    p.add_argument("--top", type=positive_int, default=5, help="layouts to print (default 5)")
    p.add_argument("--verify", action="store_true", help="run the first 3 here and print predicted against measured")
    p.add_argument("--steps", type=positive_int, default=30, help="--verify: steps of each run (default 30)")
    p.add_argument("--json", action="store_true", help='print {"layouts": [...]}, best first')
    return p


def main(argv=None):
    from .command import calibration_path
    from .files import load_cluster
    args = build_parser().parse_args(argv)
    try:
        cluster = here.cluster_here(args.calibration or calibration_path()) if args.cluster == "here" \
            else load_cluster(args.cluster)
        ranked, dropped = rank(args.model, args.workers, cluster, args.memory_gb)
    except ValueError as e:
        print(f"paratrain plan: error: {e}", file=sys.stderr)
        return 2
    rows = [row(args.model, args.workers, *r) for r in ranked]
    if args.verify:
        rows[:3] = verify(args, ranked[:3], rows[:3])
    if args.json:
        print(json.dumps({"cluster": cluster.name, "layouts": rows,
                          "rejected": [{"strategy": l.strategy, "flags": l.flags, "why": w} for l, w in dropped]},
                         indent=1))
        return 0 if rows else 1
    show(args, cluster, rows, dropped)
    return 0 if rows else 1


def show(args, cluster, rows, dropped):
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"paratrain plan: {args.model} on {args.workers} workers, {cluster.name}")
    for name in ("#", "strategy", "dp x pp x tp", "micro-batches", "step", "samples/s", "memory/worker"):
        t.add_column(name, justify="right")
    measured = any("measured_step_ms" in r for r in rows)
    if measured:
        t.add_column("measured step", justify="right")
        t.add_column("measured memory", justify="right")
    t.add_column("command", justify="left")
    for i, r in enumerate(rows[:max(args.top, 3 if measured else 0)], 1):
        name = r["strategy"] + (f" + {r['compression']}" if r.get("compression") else "")
        cells = [str(i), name, f"{r['dp']} x {r['pp']} x {r['tp']}", str(r["microbatches"] or "-"),
                 f"{r['predicted_step_ms']:.1f} ms", f"{r['predicted_samples_per_s']:,.0f}",
                 f"{r['predicted_memory_mb']:.0f} MiB"]
        if measured:
            cells += [f"{r['measured_step_ms']:.1f} ms" if "measured_step_ms" in r else "",
                      f"{r['measured_memory_mb']:.0f} MiB" if r.get("measured_memory_mb") else ""]
        t.add_row(*cells, r["command"])
    Console(width=max(Console().width, 160)).print(t)
    if dropped:
        print(f"{len(dropped)} layouts left out, e.g. {dropped[0][0].strategy} "
              f"({' '.join(dropped[0][0].flags)}): {dropped[0][1]}")


def verify(args, ranked, rows):
    """Run each layout here (as compare runs a strategy) and add what was measured to its row."""
    import os
    import tempfile

    from ..compare.runs import one_fork_server, run_one
    folder = tempfile.mkdtemp(prefix="paratrain-plan-")
    os.makedirs(os.path.join(folder, "logs"))
    common = ["--model", args.model, "--workers", str(args.workers), "--runs", folder, "--steps", str(args.steps)]
    out = []
    with one_fork_server():
        for (layout, _, _), r in zip(ranked, rows):
            got = run_one(f"{len(out) + 1}-{layout.strategy}", common, folder, layout.flags)
            r = dict(r)
            if "unavailable" not in got:
                r.update(measured_step_ms=got["step_ms"], measured_samples_per_s=got["samples_per_s"],
                         measured_memory_mb=got["peak_memory_mb"], run_dir=got["run_dir"])
            out.append(r)
    return out
