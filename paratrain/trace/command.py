"""``paratrain trace PATH``: where each rank's time went, the stragglers, who was late.

    paratrain trace runs/<id>            (a run folder, a trace folder, or trace.json[.gz])
    paratrain trace runs/<id> --json     the same figures as JSON
    paratrain trace --flight DIR         where the ranks' flight-recorder dumps part
"""
import argparse
import json
import os
import sys

from ..train.argtypes import positive_int
from . import analysis, gantt


def build_parser():
    p = argparse.ArgumentParser(prog="paratrain trace", description=__doc__.splitlines()[0].strip("`"))
    p.add_argument("path", nargs="?", help="a run folder (runs/<id>), a trace folder, or a trace.json[.gz]")
    p.add_argument("--flight", metavar="DIR", default=None,
                   help="read the flight recorder's dumps in DIR (runs/<id>/flight, or the folder an error named)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--steps", type=positive_int, default=3, help="steps drawn in trace.png (default 3)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="do not write trace.png")
    return p


def analyse_and_plot(path, steps=3, plot=True):
    """The analysis of the trace at ``path`` and, with ``plot``, trace.png beside it (its
    path under "plot"), from one reading of the file."""
    trace_file = analysis.find_trace(path)
    events = analysis.load(trace_file)
    result = analysis.analyse(trace_file, events)
    if plot:
        folder = os.path.dirname(os.path.abspath(trace_file))
        result["plot"] = gantt.plot(events, os.path.join(folder, "trace.png"),
                                    f"{os.path.basename(folder)}: the last {steps} steps")
    return result


def report(result):
    """The analysis as lines of text."""
    lines = [f"trace: {result['trace']}",
             f"{'rank':>4}  {'steps':>5}  {'step ms':>8}  {'compute':>8}  {'data':>6}  {'exposed':>8}  "
             f"{'wait':>8}  {'idle':>8}  {'overlap':>7}  {'starved':>8}  bubble"]
    for r in result["ranks"]:
        n = max(1, r["steps"])

        def ms(key):
            return f"{r[key] / n * 1e3:8.2f}"
        bubble = f"{r['bubble']:6.1%}" if "bubble" in r else "     -"
        lines.append(f"{r['rank']:>4}  {r['steps']:>5}  {ms('step_s')}  {ms('compute_s')}  "
                     f"{r['data_s'] / n * 1e3:6.2f}  {ms('exposed_comm_s')}  {ms('wait_s')}  {ms('idle_s')}  "
                     f"{r['overlap']:7.1%}  {ms('starved_s')}  {bubble}")
    lines.append("(milliseconds per step; overlap: the share of communication with compute beside it; starved: "
                 "of compute, waiting for a CPU)")
    if result["stragglers"]:
        for s in result["stragglers"]:
            lines.append(f"straggler: rank {s['rank']}, its own work {s['factor']:.2f}x the median rank's")
    else:
        lines.append("no straggler: every rank's own work is within 10% of the median")
    for a in result["last_arrivals"]:
        if a.get("outside"):
            lines.append(f"before and after the steps: rank {a['rank']} arrived last in {a['share']:.0%} of "
                         f"{a['calls']} {a['op']}s; the others waited {a['others_wait_s']:.2f} s in all for it")
        else:
            lines.append(f"rank {a['rank']} arrived last in {a['share']:.0%} of {a['calls']} {a['op']}s; "
                         f"the others waited {a['others_wait_s_per_step'] * 1e3:.1f} ms a step for it")
    for w in result.get("staleness", []):
        lines.append(f"worker {w['worker']} read {w['reads']} times, {w['mean_lag']:.2f} clocks ahead of the "
                     f"slowest worker on average, at most {w['max_lag']}")
    if result.get("plot"):
        lines.append(f"plot: {result['plot']}")
    return lines


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.flight:
        from . import flight_report
        try:
            print("\n".join(flight_report.report(args.flight)))
        except (FileNotFoundError, ValueError) as e:
            print(f"paratrain trace: error: {e}", file=sys.stderr)
            return 2
        return 0
    if not args.path:
        parser.print_usage(sys.stderr)
        print("paratrain trace: error: give a run folder or a trace file, or --flight DIR", file=sys.stderr)
        return 2
    try:
        result = analyse_and_plot(args.path, args.steps, args.plot)
    except (FileNotFoundError, ValueError) as e:
        print(f"paratrain trace: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print("\n".join(report(result)))
    return 0
