"""How fast is pt.ZeRO beside paratrain's DataParallel and torch's ZeRO (ZeroRedundancyOptimizer, FSDP2)?

    paratrain bench zero [--rounds 5] [--engines ...] [--quick]
    python benchmarks/zero.py            (the same)

The GPT benchmarks' model (gpt_runs.py): the gpt task made bigger (8 blocks, width 256, 8
heads, context 128: 6.5M parameters), global batch 16 (8 a rank), Adam, 2
ranks, one thread each. Every engine runs in the same 2 processes,
interleaved round by round (zero_worker.py): paratrain's DataParallel and
ZeRO stages 1-3, and torch's DDP, DDP with ZeroRedundancyOptimizer and FSDP2.

Prints ms/step, samples/s, the ratios that judge ZeRO's cost (our stages 1
and 2 against our DataParallel; stage 1 against ZeroRedundancyOptimizer;
stage 3 against FSDP2), each engine's first loss (the same weights and data:
equal), and the bytes each rank held after a backward, measured, with the
paper's formula for ours. Writes benchmarks/results/zero.json and zero.png.
"""
import argparse
import statistics
import sys
import tempfile

from . import gpt_runs

MODEL = dict(layers=8, width=256, heads=8, context=128, batch=16)
QUICK = dict(layers=2, width=64, heads=4, context=32, batch=8)
ENGINES = ["pt/dp", "pt/zero1", "pt/zero2", "pt/zero3", "pt/zero3-noprefetch", "torch/ddp", "torch/zero1",
           "torch/fsdp2"]
VERSUS = {"pt/zero1": ["pt/dp", "torch/zero1"], "pt/zero2": ["pt/dp"],
          "pt/zero3": ["torch/fsdp2", "pt/zero3-noprefetch"],
          "pt/dp": ["torch/ddp"]}


def parser():
    p = argparse.ArgumentParser(prog="paratrain bench zero",
                                description="pt.ZeRO stages 1-3 vs DataParallel, ZeroRedundancyOptimizer and FSDP2")
    p.add_argument("--engines", default=",".join(ENGINES), help="engines, comma-separated")
    gpt_runs.add_common_options(p)
    return p


def summarize(result, model):
    from ..train.strategies.zero import formula
    medians = {e: statistics.median(t) for e, t in result["times"].items()}
    P = None
    rows = []
    for engine, step in medians.items():
        held = result["bytes"][engine]
        total = sum(held.values()) if held else None
        stage = int(engine[len("pt/zero")]) if engine.startswith("pt/zero") else None
        if P is None and engine == "pt/dp" and held:
            P = held["parameters"] / 4
        rows.append(dict(engine=engine, step_ms=step * 1e3, samples_per_s=model["batch"] / step,
                         vs={other: medians[other] / step for other in VERSUS.get(engine, []) if other in medians},
                         first_loss=result["first_loss"][engine], bytes=held, total_mb=total / 1e6 if total else None,
                         formula_mb=None, stage=stage))
    for r in rows:
        if r["stage"] and P:
            r["formula_mb"] = formula(r["stage"], P, 2) / 1e6
    return rows


def table(rows):
    from rich.table import Table
    t = Table(title="ZeRO, 2 ranks: ms/step and samples/s, medians of interleaved rounds")
    for c in ("engine", "step ms", "samples/s", "against", "first loss", "params / grads / Adam MB a rank",
              "in all MB", "formula MB"):
        t.add_column(c, justify="left" if c in ("engine", "against") else "right")
    for r in rows:
        b = r["bytes"]
        t.add_row(r["engine"], f"{r['step_ms']:.0f}", f"{r['samples_per_s']:.1f}",
                  ", ".join(f"{v:.2f}x {k}" for k, v in r["vs"].items()) or "-", f"{r['first_loss']:.6f}",
                  " / ".join(f"{b[k] / 1e6:.1f}" for k in ("parameters", "gradients", "optimizer")) if b else "-",
                  f"{r['total_mb']:.1f}" if r["total_mb"] else "-",
                  f"{r['formula_mb']:.1f}" if r["formula_mb"] else "-")
    return t


def plot(path, rows):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    names = [r["engine"] for r in rows]
    colours = ["#4C72B0" if n.startswith("pt/") else "#DD8452" for n in names]
    left.bar(range(len(rows)), [r["samples_per_s"] for r in rows], color=colours)
    left.set_xticks(range(len(rows)), names, rotation=35, ha="right", fontsize=8)
    left.set_ylabel("samples/s (2 ranks)")
    right.bar(range(len(rows)), [r["total_mb"] or 0 for r in rows], color=colours)
    right.set_xticks(range(len(rows)), names, rotation=35, ha="right", fontsize=8)
    right.set_ylabel("MB a rank holds: parameters + gradients + Adam")
    fig.suptitle("ZeRO: paratrain (blue) and torch (orange), gpt 6.5M, 2 ranks")
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    args = parser().parse_args(argv)
    model = gpt_runs.model_of(args, MODEL, QUICK)
    engines = gpt_runs.words(args.engines)
    with tempfile.TemporaryDirectory() as tmp:
        result = gpt_runs.run_workers(2, "paratrain.bench.zero_worker", engines, model, args, tmp)
    rows = summarize(result, model)
    out = gpt_runs.show_and_save(table(rows), "zero", model, args, rows, result, times=result["times"])
    png = plot(out / "zero.png", rows)
    print(f"wrote {out / 'zero.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
