"""``paratrain bench trace``: what ``--trace`` costs, and how well the ranks' clocks line up.

    paratrain bench trace [--rounds 3] [--tasks gpt,mlp-large,pipeline] [--steps 60]

Each round runs every task once with ``--trace``, recording every other
step only, so traced and untraced steps alternate in one run and meet the
same machine, the same processes and the same memory (separate runs differ
by a few percent on their own: where the scheduler puts them, what else
ran). A round's figure is the median time of its traced steps over that of
its untraced ones, the first few steps left out (metrics.jsonl); the table
gives it per round and the median. From each traced run it also
reads how far apart the same collective ends on the ranks after the clock
correction (an all_reduce ends on every rank at nearly the same moment: the
last bytes arrive everywhere together), the median and the 90th percentile.
Last, the always-on part: the median latency of a 4 KiB all_reduce on 2
ranks with the flight recorder off (``PARATRAIN_FLIGHT_RECORDER=0``) and on
(the default), in the same interleaved rounds.
Writes benchmarks/results/trace.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ..launch import forkserver
from ..trace import analysis
from ..train.argtypes import positive_int

TASKS = {
    "gpt": ["--model", "gpt"],
    "mlp-large": ["--model", "mlp-large"],
    "pipeline": ["--model", "gpt", "--pp", "2"],
}
WARMUP_STEPS = 5
SYMMETRIC = ("all_reduce", "all_gather", "reduce_scatter", "barrier")   # they end together on every rank


def run(task, steps, runs):
    """One run of ``task`` traced every other step: (median untraced step s, median traced
    step s, the run folder)."""
    cmd = [sys.executable, "-m", "paratrain", "train", *TASKS[task], "--workers", "2", "--steps", str(steps),
           "--runs", runs, "--eval-every", str(steps), "--trace", "--trace-every-other"]
    res = forkserver.run(cmd, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    run_dir = max((os.path.join(runs, d) for d in os.listdir(runs)), key=os.path.getmtime)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][WARMUP_STEPS:]
    times = {flag: [r["step_seconds"] for r in rows if r.get("traced") is flag] for flag in (False, True)}
    return statistics.median(times[False]), statistics.median(times[True]), run_dir


def end_spread_us(run_dir):
    """The spread of the same collective's end across ranks, per call: (median, p90) in us
    (None, None) when the run had none."""
    ends = {}
    for e in analysis.load(run_dir):
        a = e.get("args") or {}
        if e.get("ph") == "X" and e.get("cat") == "comm" and "seq" in a and e["name"] in SYMMETRIC:
            ends.setdefault((a["group"], a["seq"]), []).append(e["ts"] + e["dur"])
    spreads = sorted(max(v) - min(v) for v in ends.values() if len(v) > 1)
    if not spreads:
        return None, None
    return statistics.median(spreads), spreads[int(0.9 * (len(spreads) - 1))]


LATENCY = """\
import time, torch, paratrain as pt
g = pt.init()
t = torch.ones(1024)
for _ in range(500):
    g.all_reduce(t)
runs = []
for _ in range(5):
    g.barrier()
    t0 = time.perf_counter()
    for _ in range(4000):
        g.all_reduce(t)
    runs.append((time.perf_counter() - t0) / 4000)
if g.rank == 0:
    print("LATENCY", sorted(runs)[2])
pt.destroy()
"""


def latency(flight_on, script):
    """The median 4 KiB all_reduce latency (s) of one 2-rank run."""
    env = dict(os.environ, PARATRAIN_FLIGHT_RECORDER="2000" if flight_on else "0")
    res = subprocess.run([sys.executable, "-m", "paratrain", "run", "-n", "2", script], capture_output=True,
                         text=True, timeout=300, env=env)
    line = next((x for x in res.stdout.splitlines() if "LATENCY" in x), None)
    if res.returncode != 0 or line is None:
        raise SystemExit(f"the latency run failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return float(line.split()[-1])


def _us(x):
    return "-" if x is None else f"{x:.0f} us"


def main(argv=None):
    p = argparse.ArgumentParser(prog="paratrain bench trace", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--steps", type=positive_int, default=60)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "trace.json"))
    args = p.parse_args(argv)
    tasks = args.tasks.split(",")
    rows = {t: [] for t in tasks}
    rows["all_reduce 4 KiB"] = []
    with tempfile.TemporaryDirectory() as runs:
        script = os.path.join(runs, "latency.py")
        with open(script, "w") as f:
            f.write(LATENCY)
        for r in range(args.rounds):
            off, on = latency(False, script), latency(True, script)
            rows["all_reduce 4 KiB"].append({"flight_recorder_off_s": off, "flight_recorder_on_s": on, "ratio": on / off})
            print(f"round {r + 1}/{args.rounds} all_reduce 4 KiB: flight recorder off {off * 1e6:.1f} us, "
                  f"on {on * 1e6:.1f} us ({on / off:.3f}x)", flush=True)
            for t in tasks:
                off, on, run_dir = run(t, args.steps, runs)
                spread = end_spread_us(run_dir)
                rows[t].append({"untraced_s": off, "traced_s": on, "ratio": on / off,
                                "end_spread_median_us": spread[0], "end_spread_p90_us": spread[1]})
                print(f"round {r + 1}/{args.rounds} {t}: untraced {off * 1e3:.1f} ms, traced {on * 1e3:.1f} ms "
                      f"({on / off:.3f}x); the same collective ends within {_us(spread[0])} (median), "
                      f"{_us(spread[1])} (p90)", flush=True)
    print(f"\n{'task':<10} {'traced / untraced, per round':<36} {'median':>7}  the same collective's end across ranks, median/p90")
    off_on = [x["ratio"] for x in rows["all_reduce 4 KiB"]]
    print(f"{'4 KiB':<10} {' '.join(f'{x:.3f}' for x in off_on):<36} {statistics.median(off_on):7.3f}  "
          "(all_reduce latency, flight recorder on / off)")
    for t in tasks:
        ratios = [x["ratio"] for x in rows[t]]
        spreads = " ".join(f"{_us(x['end_spread_median_us'])}/{_us(x['end_spread_p90_us'])}" for x in rows[t])
        print(f"{t:<10} {' '.join(f'{x:.3f}' for x in ratios):<36} {statistics.median(ratios):7.3f}  {spreads}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "rounds": args.rounds, "tasks": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
