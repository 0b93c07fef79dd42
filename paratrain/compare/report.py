"""What compare shows: a row per strategy from its run folder, and the three files.

Each strategy's row comes from its run's summary.json and metrics.jsonl:

- samples_per_s: the job's (summary.py: every batch over the longest loop);
- step_ms: the median of rank 0's step times (metrics.jsonl's step_seconds:
  the step itself, without the evaluations and checkpoints between steps);
- compute_ms: the median of rank 0's compute (compute_seconds: its forward and
  backward, less the time it waited on others);
- bytes_per_step: what rank 0 sent a step (compressed: what went on the wire);
- peak_memory_mb: the largest worker's peak heap growth (train/memory.py);
- slowest_compute_ratio, mean_compute_ratio: the slowest worker's mean compute a
  step, and the workers' mean, over rank 0's;
- loss: the last logged; time_to_target_s with --target-loss;
- with --rounds N, the strategy's median run of its N (median_run), and
  ``rounds``, every run's samples/s, step and predictions;
- predicted_step_ms (compare/command.py, with a calibration): the mean of the model's
  prediction timed just before the run and just after, predicted_before_after_ms;
  predicted_parts_ms, the mean's parts;
- predicted_from_run_compute_ms: the model again with every timing scaled by
  run_compute_speed, the run's compute over what the model takes a worker's to be
  (plan.predict_from_run: compute_ms, times slowest_compute_ratio where the workers
  go in lockstep and mean_compute_ratio for a pipeline), and spread as the run's
  steps were (compute_jitter_ms, their spread from one step to the next, over
  compute_ms): the model's communication, bubbles and waits checked at the speed
  the run had, which the timings before and after may miss;
- pace_ms, samples_per_s_at_pace (with predicted_from_run_compute_ms): the model's whole
  step at the speed the run computed at (run_compute_speed), how fast this host computed
  during the run in units alike for every strategy, and the run's samples/s brought to
  the median pace of all the compare's runs (at_one_pace); a strategy's row, the median
  of its runs' at that pace.

compare.png: loss against wall time, a line per strategy, and bars of memory
and bytes per step.
"""
import json
import os
import statistics

from ..simulate.waits import step_to_step_spread
from ..train.metrics import read_metrics

MB = 1 << 20
MOVED = 0.10   # the host's speed moved this much across a run: its prediction is of another speed


def row_from_run(name, run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    metrics = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steps = [m["step_seconds"] for m in metrics if "step_seconds" in m]
    computed = [m["compute_seconds"] for m in metrics if "compute_seconds" in m]
    row = {"strategy": name, "samples_per_s": s["samples_per_s"],
           "step_ms": 1e3 * statistics.median(steps) if steps else None,
           "compute_ms": 1e3 * statistics.median(computed) if computed else None,
           "compute_jitter_ms": 1e3 * step_to_step_spread(computed),
           "steps": s["steps"], "loss": s["final_loss"],
           "bytes_per_step": (s.get("bytes_communicated") or 0) / s["steps"] if s["steps"] else None,
           "peak_memory_mb": s.get("peak_memory_mb"), "run_dir": run_dir}
    means = [w["compute_s"] / w["batches"] for w in s.get("per_worker") or [] if w.get("batches")]
    if len(means) > 1 and means[0] > 0:
        row["slowest_compute_ratio"] = max(means) / means[0]
        row["mean_compute_ratio"] = sum(means) / len(means) / means[0]
    if "time_to_target_s" in s:
        row["time_to_target_s"] = s["time_to_target_s"]
    return row


ROUND_FIELDS = ("samples_per_s", "samples_per_s_at_pace", "pace_ms", "whole_steps_per_compute", "step_ms",
                "predicted_step_ms", "predicted_from_run_compute_ms", "run_dir")


def at_one_pace(runs):
    """Give each run that has a ``pace_ms`` its ``samples_per_s_at_pace``: its samples/s times
    its pace over the median pace of them all. A shared host's speed moves within the
    half hour a compare takes by more than strategies differ: a strategy run at a
    slow minute would rank below one run at a fast minute. The pace is read from the run
    itself: its workers' compute a step, times ``whole_steps_per_compute``, what the model
    says a second of that strategy's compute (a pipeline's stage, a tensor worker's cut
    model, data parallelism's whole model) is worth of the model's whole step, so one unit
    for every strategy. That ratio comes from a timing (a stage's, a third of a second
    long, moves from one prediction to the next), so a strategy's runs share the median of
    theirs: between its own runs only their compute tells their paces apart. A run that
    computed 10% slower than the median is shown 10% faster. A pace timed apart from the
    run (the model's step just before it and just after) reads the seconds around the run,
    not its thirty, and spread a strategy's runs wider, not narrower."""
    paced = [r for r in runs if r.get("pace_ms") and r.get("samples_per_s")]
    if not paced:
        return
    worths = {}
    for r in paced:
        if r.get("whole_steps_per_compute"):
            worths.setdefault(r["strategy"], []).append(r["whole_steps_per_compute"])
    shared = {name: statistics.median(values) for name, values in worths.items()}
    paces = [r["pace_ms"] * shared[r["strategy"]] / r["whole_steps_per_compute"]
             if r.get("whole_steps_per_compute") else r["pace_ms"] for r in paced]
    middle = statistics.median(paces)
    for r, pace in zip(paced, paces):
        r["samples_per_s_at_pace"] = r["samples_per_s"] * pace / middle


def median_run(runs):
    """A strategy's row from its runs, one a round (compare --rounds): the run of median
    samples/s (the lower middle one of an even count), so that its loss, memory and
    prediction are all one run's; past one run, ``rounds`` holds every run's figures in the
    order they ran, ``samples_per_s_range`` the lowest and the highest, and
    ``samples_per_s_at_pace`` the median of the runs' at one pace."""
    ran = [r for r in runs if "unavailable" not in r]
    if len(runs) == 1 or not ran:
        return runs[0]
    row = dict(sorted(ran, key=lambda r: r["samples_per_s"])[(len(ran) - 1) // 2])
    row["rounds"] = [{k: r[k] for k in ROUND_FIELDS if k in r} if "unavailable" not in r
                     else {"unavailable": r["unavailable"]} for r in runs]
    speeds = [r["samples_per_s"] for r in ran]
    row["samples_per_s_range"] = [min(speeds), max(speeds)]
    at_pace = [r["samples_per_s_at_pace"] for r in ran if "samples_per_s_at_pace" in r]
    if at_pace:
        row["samples_per_s_at_pace"] = statistics.median(at_pace)
    return row


def _samples_cell(row):
    """'368' or, for a median of rounds, '368 (325-378)'."""
    spread = row.get("samples_per_s_range")
    return _cell(row["samples_per_s"], ",.0f") + (f" ({spread[0]:,.0f}-{spread[1]:,.0f})" if spread else "")


def _cell(value, fmt):
    return "-" if value is None else format(value, fmt)


def _moved(row):
    """' (before 140.1, after 160.3)': the prediction's two timings, just before the run and
    just after; their distance is how much this host's speed moved meanwhile."""
    pair = row.get("predicted_before_after_ms")
    return f" (before {pair[0]:.1f}, after {pair[1]:.1f})" if pair else ""


def host_moved(rows):
    """[(strategy, how far the prediction's two timings are apart)] where that is over MOVED:
    runs whose predicted and measured steps were taken at different speeds of this host."""
    out = []
    for r in rows:
        pair = r.get("predicted_before_after_ms")
        apart = pair and abs(pair[1] - pair[0]) / min(pair)
        if apart and apart > MOVED:
            out.append((r["strategy"], apart))
    return out


CLOSE = 0.10   # a prediction this close to the measured step counts as close


def accuracy(rows):
    """One line: how many of the runs' steps the model predicted within CLOSE, each way."""
    ran = [r for r in rows if r.get("step_ms")]

    def close(key):
        return sum(1 for r in ran if r.get(key) and abs(r[key] / r["step_ms"] - 1) <= CLOSE)
    line = f"The model's step within {CLOSE:.0%} of the measured: {close('predicted_step_ms')} of {len(ran)} as timed"
    if any("predicted_from_run_compute_ms" in r for r in ran):
        line += f", {close('predicted_from_run_compute_ms')} of {len(ran)} from their compute"
    return line + "."


def fastest(rows, key):
    """The strategy of the most ``key`` (samples/s, or at one pace) among the rows that ran."""
    ran = [r for r in rows if r.get(key)]
    return max(ran, key=lambda r: r[key])["strategy"] if ran else None


def markdown(rows, title):
    predicted = any("predicted_step_ms" in r for r in rows)
    from_run = any("predicted_from_run_compute_ms" in r for r in rows)
    paced = any("samples_per_s_at_pace" in r for r in rows)
    lines = [f"# {title}", "",
             "| strategy | samples/s | " + ("at one pace | " if paced else "") + "step | "
             + ("predicted step | " if predicted else "") + ("predicted from its compute | " if from_run else "")
             + "bytes/step | peak memory/worker | loss | time to target |",
             "| --- | ---: | ---: | " + ("---: | " * (paced + predicted + from_run)) + "---: | ---: | ---: | ---: |"]
    for r in rows:
        if "unavailable" in r:
            lines.append(f"| {r['strategy']} | not run: {r['unavailable']} | | | | | |"
                         + " |" * (paced + predicted + from_run))
            continue
        pace = f"{_cell(r.get('samples_per_s_at_pace'), ',.0f')} | " if paced else ""
        target = r.get("time_to_target_s")
        guess = f"{_cell(r.get('predicted_step_ms'), '.1f')} ms{_moved(r)} | " if predicted else ""
        if from_run:
            own = r.get("predicted_from_run_compute_ms")
            guess += "- | " if own is None else f"{own:.1f} ms (x{r['run_compute_speed']:.2f}) | "
        lines.append(f"| {r['strategy']} | {_samples_cell(r)} | {pace}{_cell(r['step_ms'], '.1f')} ms | "
                     f"{guess}"
                     f"{_cell(r['bytes_per_step'] and r['bytes_per_step'] / MB, '.2f')} MiB | "
                     f"{_cell(r['peak_memory_mb'], '.0f')} MiB | {_cell(r['loss'], '.4f')} | "
                     f"{'-' if target is None else f'{target:.1f} s'} |")
    rounds = max((len(r.get("rounds", ())) for r in rows), default=0)
    if rounds:
        lines += ["", f"Each strategy ran {rounds} times, in alternating order; its row is its median run by "
                  "samples/s, beside its lowest and highest."]
    if paced:
        lines += ["", "At one pace: each run's samples/s brought to the median speed this host computed at "
                  "across the runs (each run's compute a step, in the model's whole steps); this host's speed "
                  f"drifts by more than strategies differ. Fastest: {fastest(rows, 'samples_per_s')} as run, "
                  f"{fastest(rows, 'samples_per_s_at_pace')} at one pace."]
    if from_run:
        lines += ["", "Predicted from its compute: the model again at the speed the run computed at, and as "
                  "unsteadily (x: the run's compute a step over the model's timing of it; 1.20, 20% slower)."]
    if predicted:
        lines += ["", accuracy(rows)]
    moved = host_moved(rows)
    if moved:
        lines += ["", "This host's speed moved by more than {:.0%} across the runs of {}: their predicted and "
                  "measured steps were timed at different speeds. Run them again "
                  "(`--strategies {}`) to compare the model with a run at one speed."
                  .format(MOVED, ", ".join(f"{name} ({share:.1%})" for name, share in moved),
                          ",".join(name for name, _ in moved))]
    return "\n".join(lines) + "\n"


def smoothed(values, share=0.05):
    """Each value's mean with the ones before it, over a window of ``share`` of them: a
    step's loss moves by more than the strategies differ."""
    import numpy as np
    window = max(1, int(len(values) * share))
    sums = np.cumsum(np.concatenate([[0.0], np.asarray(values, dtype=float)]))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(values) + 1) - counts]) / counts


def plot(rows, path, title):
    """Loss against wall time (a line per strategy) beside bars of memory and bytes per step."""
    from matplotlib import cm
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    ran = [r for r in rows if "unavailable" not in r]
    fig = Figure(figsize=(13, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    colors = [cm.tab20(i % 20) for i in range(len(ran))]
    for r, color, style in zip(ran, colors, ["-", "--", ":", "-."] * len(ran)):
        pts = [(m["time"], m["loss"]) for m in read_metrics(os.path.join(r["run_dir"], "metrics.jsonl"))
               if "time" in m and "loss" in m]
        ax.plot([t for t, _ in pts], smoothed([v for _, v in pts]), style, color=color, linewidth=1.3,
                label=r["strategy"])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("training loss (rank 0's log, mean of the last 5% of steps)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ran:
        ax.legend(fontsize=8)
    bars = fig.add_subplot(1, 2, 2)
    x = range(len(ran))
    memory = [r["peak_memory_mb"] or 0 for r in ran]
    sent = [(r["bytes_per_step"] or 0) / MB for r in ran]
    bars.bar([i - 0.2 for i in x], memory, width=0.4, color="tab:blue", label="peak memory / worker (MiB)")
    other = bars.twinx()
    other.bar([i + 0.2 for i in x], sent, width=0.4, color="tab:orange", label="sent / step (MiB)")
    bars.set_xticks(list(x), [r["strategy"] for r in ran], rotation=45, ha="right", fontsize=8)
    bars.set_ylabel("peak memory per worker (MiB)", color="tab:blue")
    other.set_ylabel("bytes sent per step, rank 0 (MiB)", color="tab:orange")
    bars.set_title("memory and communication")
    fig.tight_layout()
    fig.savefig(path)
    return path


def write(folder, rows, title):
    """compare.md, compare.json and compare.png in ``folder``; returns their paths."""
    paths = [os.path.join(folder, f"compare.{ext}") for ext in ("md", "json", "png")]
    with open(paths[0], "w") as f:
        f.write(markdown(rows, title))
    with open(paths[1], "w") as f:
        json.dump({"title": title, "rows": rows}, f, indent=1)
    plot(rows, paths[2], title)
    return paths
