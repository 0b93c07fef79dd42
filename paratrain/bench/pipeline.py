"""How fast is paratrain's pipeline beside one process and torch.distributed.pipelining?

    paratrain bench pipeline [--rounds 5] [--engines ...] [--quick]
    python benchmarks/pipeline.py            (the same)

The GPT benchmarks' model (gpt_runs.py): the gpt task made bigger (8 blocks, width 256, 8
heads, context 128: 6.5M parameters), batch 16, Adam, one thread per rank,
cut into 2 stages of 4 blocks. Two workers time, interleaved round by round
(pipeline_worker.py): one process with the whole model (``single``, on rank 0
while rank 1 sleeps), paratrain's schedules and torch's GPipe and 1F1B on the
same stage modules, and ``alone/m<m>``: each stage's m forwards and backwards
with no pipeline between them, both stages at once, which no schedule can
beat (the formula's ideal assumes each stage is half a one-process step).

Prints ms/step, samples/s, the speedup over one process against the ideal
2m/(m+1) for two stages and against the same ideal on this machine (the
formula's bubble, 1/(m+1) of the step, added to what ``alone/m<m>`` takes
instead of to half a one-process step: ``alone``'s speedup x m/(m+1); two
busy cores are often each slower than one alone, which the plain formula
does not know), the ratio to torch's same schedule (zb-h1 and
interleaved against torch's 1F1B at the same m), paratrain's bubble
measured on each round's last step (median) against the schedule's formula,
and the most activation memory each of paratrain's stages held at once.
Writes benchmarks/results/pipeline.json, pipeline.png, and the timeline of
each of our engines' last step (pipeline-timeline-<engine>.png).
"""
import argparse
import statistics
import sys
import tempfile

from . import gpt_runs

MODEL = dict(layers=8, width=256, heads=8, context=128, batch=16)
QUICK = dict(layers=4, width=64, heads=4, context=32, batch=8)
ENGINES = ["pt/gpipe/m2", "pt/gpipe/m4", "pt/gpipe/m8", "pt/1f1b/m2", "pt/1f1b/m4", "pt/1f1b/m8",
           "pt/zb-h1/m4", "pt/zb-h1/m8", "pt/interleaved/m8",
           "torch/gpipe/m2", "torch/gpipe/m4", "torch/gpipe/m8", "torch/1f1b/m2", "torch/1f1b/m4", "torch/1f1b/m8",
           "alone/m4", "alone/m8"]


def parser():
    p = argparse.ArgumentParser(prog="paratrain bench pipeline",
                                description="paratrain pipeline schedules vs one process and torch.distributed.pipelining")
    p.add_argument("--engines", default=",".join(ENGINES), help="engines on 2 workers (owner/schedule/m<m>)")
    gpt_runs.add_common_options(p)
    return p


def summarize(piped, batch):
    from ..parallel.pipeline.schedules import bubble_formula
    one = statistics.median(piped["times"]["single"])
    rows = [dict(engine="single", step_ms=one * 1e3, samples_per_s=batch / one, vs_single=1.0, ideal=1.0,
                 machine_ideal=None, vs_torch=None, bubble=None, bubble_formula=None, peak_activation_mb=None)]
    medians = {e: statistics.median(t) for e, t in piped["times"].items()}
    for engine, step in medians.items():
        if engine == "single":
            continue
        if engine.startswith("alone/"):   # the stages' compute alone: the ceiling (pipeline_worker.StagesAlone)
            rows.append(dict(engine=engine, step_ms=step * 1e3, samples_per_s=batch / step, vs_single=one / step,
                             ideal=None, machine_ideal=None, vs_torch=None, bubble=None, bubble_formula=None,
                             peak_activation_mb=None))
            continue
        owner, schedule, m = engine.split("/")
        m = int(m[1:])
        ref = f"torch/{schedule if schedule in ('gpipe', '1f1b') else '1f1b'}/m{m}"
        v = 2 if schedule == "interleaved" else 1
        bubbles = piped.get("bubble", {}).get(engine)
        alone = medians.get(f"alone/m{m}")
        rows.append(dict(engine=engine, step_ms=step * 1e3, samples_per_s=batch / step, vs_single=one / step,
                         ideal=2 * m / (m + 1), machine_ideal=one / alone * m / (m + 1) if alone else None,
                         vs_torch=medians[ref] / step if owner == "pt" and ref in medians else None,
                         bubble=statistics.median(bubbles) if bubbles else None,
                         bubble_formula=bubble_formula(schedule, 2, m, v) if owner == "pt" else None,
                         peak_activation_mb=piped.get("peak_activation_mb", {}).get(engine)))
    return rows


def table(rows):
    from rich.table import Table
    t = Table(title="2-stage pipeline: ms/step and samples/s, medians of interleaved rounds")
    for c in ("engine", "step ms", "samples/s", "vs 1 process", "ideal 2m/(m+1)", "ideal here: alone x m/(m+1)",
              "vs torch, same m",
              "bubble measured", "bubble formula", "peak activations MB, stage 0 / 1"):
        t.add_column(c, justify="left" if c == "engine" else "right")
    f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
    for r in rows:
        t.add_row(r["engine"], f"{r['step_ms']:.0f}", f"{r['samples_per_s']:.1f}", f(r["vs_single"], "{:.2f}x"),
                  f(r["ideal"], "{:.2f}x"), f(r["machine_ideal"], "{:.2f}x"), f(r["vs_torch"], "{:.2f}x"),
                  f(r["bubble"], "{:.1%}"), f(r["bubble_formula"], "{:.1%}"),
                  " / ".join(f"{x:.0f}" for x in r["peak_activation_mb"]) if r["peak_activation_mb"] else "-")
    return t


def plot(path, rows):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    names = [r["engine"] for r in rows]
    colours = ["grey" if n == "single" else ("#4C72B0" if n.startswith("pt/") else "#DD8452") for n in names]
    ax.bar(range(len(rows)), [r["vs_single"] for r in rows], color=colours)
    ax.set_xticks(range(len(rows)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("speedup over one process")
    for i, r in enumerate(rows):
        if r["ideal"] is not None and r["engine"] != "single":
            ax.plot([i - 0.4, i + 0.4], [r["ideal"]] * 2, color="black", linewidth=1)
    ax.set_title("paratrain (blue) and torch.distributed.pipelining (orange), 2 stages; lines: ideal 2m/(m+1)")
    fig.savefig(path, dpi=110)
    return path


def timelines(out, piped, rows):
    """Each of our engines' last step, drawn (parallel/pipeline/timeline.py)."""
    from ..parallel.pipeline import timeline
    by = {r["engine"]: r for r in rows}
    paths = []
    for engine, stages in piped.get("timelines", {}).items():
        r = by[engine]
        title = (f"{engine}: last step of the last round; bubble {timeline.bubble(stages):.1%} measured "
                 f"(median of rounds {r['bubble']:.1%}), {r['bubble_formula']:.1%} by the formula")
        paths.append(timeline.plot(stages, out / f"pipeline-timeline-{engine.replace('/', '-')}.png", title))
    return paths


def main(argv=None):
    args = parser().parse_args(argv)
    model = gpt_runs.model_of(args, MODEL, QUICK)
    engines = gpt_runs.words(args.engines)
    worker = "paratrain.bench.pipeline_worker"
    with tempfile.TemporaryDirectory() as tmp:
        piped = gpt_runs.run_workers(2, worker, ["single"] + [e for e in engines if e != "single"], model, args, tmp)
    rows = summarize(piped, model["batch"])
    out = gpt_runs.show_and_save(table(rows), "pipeline", model, args, rows, piped, width=140,
                                 times=piped["times"])
    png = plot(out / "pipeline.png", rows)
    pictures = timelines(out, piped, rows)
    print(f"wrote {out / 'pipeline.json'}, {png} and {len(pictures)} timelines (pipeline-timeline-*.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
