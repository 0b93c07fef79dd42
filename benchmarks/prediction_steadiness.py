"""How steady is a prediction's share of each part, timed once or as the median of three?

    python benchmarks/prediction_steadiness.py [--model gpt] [--workers 2] [--repeats 8] [--batches 2] [--out FILE]

Predicts compare's layouts of ``--model`` on ``--workers`` workers again and again, the
timings forgotten before each (as compare does before each run), and reads each one's
``whole_steps_per_compute``: the model's whole step over what the model takes a worker
of that layout to compute, both timed in the same prediction. The host's pace cancels
in it, so how much it moves from one prediction to the next is the timings' own noise,
which ranks a pipeline or a tensor group against data parallelism in ``paratrain
plan`` and brings compare's runs to one pace. Each part timed once
(``timing.PART_TIMINGS = 1``) and as the median of three (the default) alternate in
batches of ``--repeats``, so that both see the same minutes of a shared host.

Prints, for each layout and way: the range and the coefficient of variation; writes them
and every prediction's values to ``--out`` as JSON. Needs ``paratrain simulate
--calibrate`` first (this host's links).
"""
import argparse
import json
import statistics

from paratrain.simulate import plan, timing
from paratrain.simulate.command import calibration_path
from paratrain.simulate.here import cluster_here

LAYOUTS = ("dp", "pipeline", "pipeline-zb", "tensor")


def one_prediction(model, workers, cluster):
    """{layout: whole_steps_per_compute} of one prediction, timed afresh."""
    timing.forget_timings()
    with timing.standing():
        return {name: plan.whole_steps_per_compute(model, workers, name, cluster) for name in LAYOUTS}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=8, help="predictions in a batch of one way (default 8)")
    p.add_argument("--batches", type=int, default=2, help="batches of each way, alternated (default 2)")
    p.add_argument("--out", default="benchmarks/results/prediction_steadiness.json")
    args = p.parse_args()
    cluster = cluster_here(calibration_path())
    ways = {"once": 1, "median of 3": timing.PART_TIMINGS}
    seen = {way: [] for way in ways}
    for _ in range(args.batches):
        for way, times in ways.items():
            timing.PART_TIMINGS = times
            for _ in range(args.repeats):
                seen[way].append(one_prediction(args.model, args.workers, cluster))
                print(way, {k: round(v, 3) for k, v in seen[way][-1].items()}, flush=True)
    summary = {}
    print(f"\n{args.model}, {args.workers} workers: whole steps per worker's compute, "
          f"{args.repeats * args.batches} predictions each way")
    print("| layout | " + " | ".join(f"{way}: range | {way}: cv" for way in ways) + " |")
    print("| --- |" + " ---: | ---: |" * len(ways))
    for name in LAYOUTS:
        cells = []
        for way in ways:
            values = [s[name] for s in seen[way]]
            cv = statistics.stdev(values) / statistics.mean(values)
            summary.setdefault(name, {})[way] = {"min": min(values), "max": max(values), "cv": cv}
            cells += [f"{min(values):.2f}-{max(values):.2f}", f"{100 * cv:.1f}%"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "workers": args.workers, "summary": summary, "predictions": seen}, f,
                  indent=1)


if __name__ == "__main__":
    main()
