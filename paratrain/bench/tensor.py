"""How fast is paratrain's tensor parallelism beside one process and torch's own?

    paratrain bench tensor [--rounds 5] [--sizes 2,4] [--quick]
    python benchmarks/tensor.py            (the same)

The GPT benchmarks' model (gpt_runs.py): the gpt task made bigger (8 blocks, width 256, 8
heads, context 128: 6.5M parameters), batch 16, Adam, one thread per rank.
One process alone runs it first (``single``); then for each tensor-parallel
size n, n workers run paratrain's and torch's tensor parallelism in the same
processes, interleaved round by round (tensor_worker.py), ours with and
without sequence parallelism. An n above the machine's cores is
oversubscribed: it shows the trend, not a speedup.

Prints ms/step, samples/s, the speedup over one process and over torch at
the same size, each engine's first loss (equal when both cut the same model
right), parameter and Adam-state bytes per rank against the plan's
accounting (what it cuts divided by n, embeddings and norms whole), and the
bytes paratrain's collectives moved in one step against the Megatron
formula: per layer 2 all-reduces of B x T x d forward and 2 backward, plus
the token embedding's one. Writes benchmarks/results/tensor.json and
tensor.png (step time against the tensor-parallel size, both engines).
"""
import argparse
import statistics
import sys
import tempfile

from . import gpt_runs

MODEL = dict(layers=8, width=256, heads=8, context=128, batch=16)
QUICK = dict(layers=2, width=64, heads=4, context=32, batch=8)


def parser():
    p = argparse.ArgumentParser(prog="paratrain bench tensor",
                                description="paratrain tensor parallelism vs one process and torch's parallelize_module")
    p.add_argument("--sizes", default="2,4", help="tensor-parallel sizes beside one process (default 2,4)")
    p.add_argument("--engines", default="pt,pt-sp,torch",
                   help="pt, pt-sp (sequence parallelism), torch (default all three)")
    gpt_runs.add_common_options(p)
    return p


def formula_bytes(model, sequence_parallel=False):
    """Bytes of paratrain's collectives in one step of the gpt plan, per layer and in all,
    each collective counted as the whole tensor it works on (functional.traffic).

    Megatron (arXiv 1909.08053, sec. 3): 4 all-reduces of B x T x d per layer (2 forward,
    2 backward) and the token embedding's forward one. Sequence parallelism (arXiv
    2205.05198, sec. 4.2.2): each becomes a reduce-scatter plus an all-gather (the same
    bytes on the wire as one all-reduce, counted here as two), plus the region's ends (a
    gather forward at the final norm, one backward at the first block) and the
    sums of the norms' and row layers' bias gradients (6 vectors of d a layer, 2 more)."""
    B, T, d, L = model["batch"], model["context"], model["width"], model["layers"]
    activation = B * T * d * 4
    if not sequence_parallel:
        return 4 * activation, (4 * L + 1) * activation
    layer = 8 * activation + 6 * d * 4
    return layer, L * layer + 3 * activation + 2 * d * 4


def summarize(results, model):
    one = statistics.median(results[1]["times"]["single"])
    rows = []
    for n, result in sorted(results.items()):
        medians = {e: statistics.median(t) for e, t in result["times"].items()}
        for engine, step in medians.items():
            owner = engine.split("/")[0]
            per_layer_formula, step_formula = formula_bytes(model, sequence_parallel=owner == "pt-sp")
            sizes, traffic = result["sizes"][engine], result["traffic"].get(engine)
            moved = sum(traffic["bytes"].values()) if traffic else None
            rows.append(dict(
                engine=engine, tp=n, step_ms=step * 1e3, samples_per_s=model["batch"] / step, vs_single=one / step,
                vs_torch=medians[f"torch/tp{n}"] / step if owner != "torch" and f"torch/tp{n}" in medians else None,
                first_loss=result["first_loss"][engine],
                parameter_mb=sizes["parameter_bytes"] / 1e6, expected_parameter_mb=sizes["expected_parameter_bytes"] / 1e6,
                optimizer_mb=sizes["optimizer_bytes"] / 1e6,
                step_traffic_mb=None if moved is None else moved / 1e6,
                step_traffic_formula_mb=None if moved is None else step_formula / 1e6,
                layer_traffic_mb=None if moved is None else (moved - (step_formula - model["layers"] * per_layer_formula))
                / model["layers"] / 1e6,
                layer_traffic_formula_mb=None if moved is None else per_layer_formula / 1e6,
                traffic_calls=traffic["calls"] if traffic else None))
    single_params = next(r["parameter_mb"] for r in rows if r["engine"] == "single")
    for r in rows:
        r["parameter_share"] = r["parameter_mb"] / single_params
    return rows


def table(rows):
    from rich.table import Table
    t = Table(title="tensor parallelism: ms/step and samples/s, medians of interleaved rounds")
    for c in ("engine", "step ms", "samples/s", "vs 1 process", "vs torch, same size", "first loss",
              "params MB/rank (plan's accounting)", "share of 1 process", "Adam state MB/rank",
              "collectives MB/step (formula)", "MB/layer (formula)"):
        t.add_column(c, justify="left" if c == "engine" else "right")
    f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
    for r in rows:
        t.add_row(r["engine"], f"{r['step_ms']:.0f}", f"{r['samples_per_s']:.1f}", f"{r['vs_single']:.2f}x",
                  f(r["vs_torch"], "{:.2f}x"), f"{r['first_loss']:.6f}",
                  f"{r['parameter_mb']:.2f} ({r['expected_parameter_mb']:.2f})", f"{r['parameter_share']:.1%}",
                  f"{r['optimizer_mb']:.2f}",
                  "-" if r["step_traffic_mb"] is None else f"{r['step_traffic_mb']:.1f} ({r['step_traffic_formula_mb']:.1f})",
                  "-" if r["layer_traffic_mb"] is None else f"{r['layer_traffic_mb']:.2f} ({r['layer_traffic_formula_mb']:.2f})")
    return t


def plot(path, rows):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    single = next(r for r in rows if r["engine"] == "single")
    for owner, colour, label in (("pt", "#4C72B0", "paratrain"), ("pt-sp", "#55A868", "paratrain, sequence parallel"),
                                 ("torch", "#DD8452", "torch parallelize_module")):
        mine = sorted((r for r in rows if r["engine"].startswith(owner + "/")), key=lambda r: r["tp"])
        if mine:
            ax.plot([1] + [r["tp"] for r in mine], [single["step_ms"]] + [r["step_ms"] for r in mine], "o-",
                    color=colour, label=label)
    sizes = sorted({r["tp"] for r in rows})
    ax.plot(sizes, [single["step_ms"] / n for n in sizes], ":", color="grey", label="one process / n")
    ax.set_xticks(sizes)
    ax.set_xlabel("tensor-parallel size (workers; 4 oversubscribes 2 cores)")
    ax.set_ylabel("ms per step (median)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("gpt task, tensor parallelism: step time against size")
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    args = parser().parse_args(argv)
    model = gpt_runs.model_of(args, MODEL, QUICK)
    owners = gpt_runs.words(args.engines)
    sizes = [int(n) for n in gpt_runs.words(args.sizes)]
    worker = "paratrain.bench.tensor_worker"
    with tempfile.TemporaryDirectory() as tmp:
        results = {1: gpt_runs.run_workers(1, worker, ["single"], model, args, tmp)}
        for n in sizes:
            results[n] = gpt_runs.run_workers(n, worker, [f"{owner}/tp{n}" for owner in owners], model, args, tmp)
    rows = summarize(results, model)
    out = gpt_runs.show_and_save(table(rows), "tensor", model, args, rows, results, sizes=sizes,
                                 times={e: t for r in results.values() for e, t in r["times"].items()})
    png = plot(out / "tensor.png", rows)
    print(f"wrote {out / 'tensor.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
