"""The parameter server beside all-reduce, and BSP beside ASP and SSP.

    paratrain bench parameter-server [--tables 1,2,3] [--quick]
    paratrain bench parameter-server --tables 3 --modes "ssp s=3 +predict" --gpt-repeats 4
    python benchmarks/parameter_server.py            (the same)

Every row is a real ``paratrain train`` run (the same command a user types),
started from here one after another and read back from its summary.json and
metrics.jsonl, so what is measured is what users get:

1. dense MLP (``--model mlp``, 2 workers): parameter server (BSP, 1 and 2
   servers) against data parallelism over all-reduce: samples/s. Dense models
   are all-reduce's home ground; the target is the PS within 30%.
2. recommendation model (``--model recsys``: a 1M x 64 embedding table, Zipf
   ids, 2 workers): the PS with sparse rows against all-reduce of the dense
   table: samples/s and bytes moved per step per worker. Targets: >= 5x the
   samples/s, >= 50x fewer bytes.
3. the character-level GPT (``--model gpt``, 3 workers), BSP vs ASP vs
   SSP(s=1,3,8), once with ``--jitter 0.3:3`` and once with ``--straggler
   1:3``: samples/s, final evaluation loss, and the time until the training
   loss (a 20-step moving average of rank 0's) first reaches a fixed target.
   In theory, with jitter BSP's step is 2.31 compute units, a worker's mean
   1.6, so enough slack approaches 1.44x BSP; with the straggler ASP
   approaches 2.33x BSP and SSP stays near BSP. ASP and SSP(3) run once more
   with ``--predict-weights`` (weight prediction, ps/shard.py).

Writes benchmarks/results/parameter_server.json and parameter_server.png
(loss against time for table 3).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ..launch import forkserver
from ..train.argtypes import positive_float, positive_int

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MODES = [("bsp", []), ("asp", []), ("ssp s=1", ["--staleness", "1"]), ("ssp s=3", ["--staleness", "3"]),
         ("ssp s=8", ["--staleness", "8"]), ("asp +predict", ["--predict-weights"]),
         ("ssp s=3 +predict", ["--staleness", "3", "--predict-weights"])]
SLOWDOWNS = [("jitter 0.3:3", ["--jitter", "0.3:3"]), ("straggler 1:3", ["--straggler", "1:3"])]
QUICK_MODES = ("bsp", "ssp s=3 +predict")   # --quick: two of table 3's modes, each slowdown (a smoke test)


def parser():
    p = argparse.ArgumentParser(prog="paratrain bench parameter-server",
                                description="parameter server vs all-reduce; BSP vs ASP vs SSP (real training runs)")
    p.add_argument("--tables", default="1,2,3", help="which of the three tables to run (default all)")
    p.add_argument("--repeats", type=positive_int, default=2,
                   help="runs per configuration in tables 1-2 (median; default 2)")
    p.add_argument("--gpt-steps", type=positive_int, default=200,
                   help="table 3: --steps (batches per worker; default 200)")
    p.add_argument("--gpt-repeats", type=positive_int, default=1,
                   help="table 3: runs of each mode, alternated (default 1). The final loss of an asynchronous "
                        "run depends on the timing of the pushes, so one run is one draw: with more, each row "
                        "shows the mean and the range")
    p.add_argument("--modes", default=None,
                   help="table 3: comma list of the modes to run, from " + ", ".join(m for m, _ in MODES) +
                        " (default all; bsp, the reference, always runs)")
    p.add_argument("--target-loss", type=positive_float, default=None,
                   help="table 3: the training loss to time (default: BSP's final smoothed loss + 5%%)")
    p.add_argument("--quick", action="store_true", help="few steps everywhere, and in table 3 only BSP and SSP(3) "
                   "with prediction (a smoke test of the script)")
    p.add_argument("--out", default=str(OUT), help="folder for the JSON and PNG")
    p.add_argument("--timeout", type=positive_float, default=1800, help="seconds before one run is stopped")
    return p


def train(args, runs, *flags):
    """One ``paratrain train`` run; returns (summary dict, [(time, loss), ...] of rank 0)."""
    before = set(os.listdir(runs)) if os.path.isdir(runs) else set()
    cmd = [sys.executable, "-m", "paratrain", "train", "--runs", runs, *flags]
    print(f"[bench] paratrain train {' '.join(flags)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = forkserver.run(cmd, timeout=args.timeout)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    run_dir, = set(os.listdir(runs)) - before
    with open(os.path.join(runs, run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(runs, run_dir, "metrics.jsonl")) as f:
        curve = [(r["time"], r["loss"]) for r in map(json.loads, f) if "loss" in r]
    summary["wall_s"] = time.perf_counter() - t0
    return summary, curve


def smoothed(curve, window=20):
    out, acc = [], []
    for t, loss in curve:
        acc.append(loss)
        acc = acc[-window:]
        out.append((t, sum(acc) / len(acc)))
    return out


def time_to(curve, target):
    """When the smoothed loss first reached ``target`` (None if never)."""
    return next((t for t, loss in smoothed(curve) if loss <= target), None)


def table_dense(args, runs):
    steps = "20" if args.quick else "300"
    configs = [("all-reduce", ["--strategy", "allreduce"]),
               ("ps bsp, 1 server", ["--strategy", "ps", "--servers", "1"]),
               ("ps bsp, 2 servers", ["--strategy", "ps", "--servers", "2"])]
    rows = {}
    for r in range(args.repeats):   # alternate the configurations, so drift hits them alike
        for name, flags in configs:
            s, _ = train(args, runs, "--model", "mlp", "--workers", "2", "--steps", steps, "--eval-every", steps,
                         *flags)
            rows.setdefault(name, []).append(s["samples_per_s"])
    base = statistics.median(rows["all-reduce"])
    return [{"config": n, "samples_per_s": statistics.median(v), "runs": v,
             "vs_allreduce": statistics.median(v) / base} for n, v in rows.items()]


def table_sparse(args, runs):
    configs = [("all-reduce, dense table", ["--strategy", "allreduce"], "4" if args.quick else "30"),
               ("ps, sparse rows, 1 server", ["--strategy", "ps", "--servers", "1"], "20" if args.quick else "300"),
               ("ps, sparse rows, 2 servers", ["--strategy", "ps", "--servers", "2"], "20" if args.quick else "300")]
    rows = {}
    for r in range(args.repeats):
        for name, flags, steps in configs:
            s, _ = train(args, runs, "--model", "recsys", "--workers", "2", "--steps", steps, "--eval-every", steps,
                         *flags)
            rows.setdefault(name, []).append((s["samples_per_s"], s["bytes_communicated"] / s["steps"], s))
    base = rows["all-reduce, dense table"]
    base_sps = statistics.median(v[0] for v in base)
    base_bytes = statistics.median(v[1] for v in base)
    out = []
    for n, v in rows.items():
        sps, nbytes = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
        out.append({"config": n, "samples_per_s": sps, "bytes_per_step": nbytes, "vs_allreduce": sps / base_sps,
                    "fewer_bytes": base_bytes / nbytes if nbytes else float("inf"),
                    "eval_loss": v[-1][2].get("eval_loss")})
    return out


def selected_modes(args):
    """Table 3's (mode, flags): --modes (bsp always, first), or --quick's two, or all."""
    if args.quick:
        names = QUICK_MODES
    elif args.modes:
        names = ["bsp"] + [m.strip() for m in args.modes.split(",") if m.strip() and m.strip() != "bsp"]
        unknown = [m for m in names if m not in dict(MODES)]
        if unknown:
            raise SystemExit(f"--modes: unknown {unknown}; choose from {', '.join(m for m, _ in MODES)}")
    else:
        names = [m for m, _ in MODES]
    return [(m, dict(MODES)[m]) for m in names]


def table_consistency(args, runs):
    """Each slowdown: every mode, --gpt-repeats times, alternated so drift hits them alike.
    A row's samples/s is the median of its runs, its loss the mean, with every run's kept."""
    steps = str(20 if args.quick else args.gpt_steps)
    modes = selected_modes(args)
    out, curves = [], {}
    for slow_name, slow in SLOWDOWNS:
        results = {}
        for _ in range(max(1, args.gpt_repeats)):
            for mode, extra in modes:
                flags = ["--model", "gpt", "--workers", "3", "--strategy", "ps", "--servers", "1", "--steps", steps,
                         "--eval-every", steps, "--consistency", mode.split()[0], *extra, *slow]
                results.setdefault(mode, []).append(train(args, runs, *flags))
                curves.setdefault(f"{slow_name} / {mode}", results[mode][0][1])
        bsp_sps = statistics.median(s["samples_per_s"] for s, _ in results["bsp"])
        bsp_loss = statistics.mean(s.get("eval_loss") or 0 for s, _ in results["bsp"]) or 1
        target = args.target_loss or smoothed(results["bsp"][0][1])[-1][1] * 1.05
        for mode, done in results.items():
            sps = statistics.median(s["samples_per_s"] for s, _ in done)
            losses = [s.get("eval_loss") or 0 for s, _ in done]
            reached = [t for t in (time_to(curve, target) for _, curve in done) if t is not None]
            out.append({"slowdown": slow_name, "mode": mode, "runs": len(done), "samples_per_s": sps,
                        "vs_bsp": sps / bsp_sps, "final_eval_loss": statistics.mean(losses),
                        "final_train_loss": smoothed(done[0][1])[-1][1],
                        "loss_vs_bsp": statistics.mean(losses) / bsp_loss - 1,
                        "loss_vs_bsp_runs": [x / bsp_loss - 1 for x in losses],
                        "samples_per_s_runs": [s["samples_per_s"] for s, _ in done],
                        "target_loss": target, "reached_target": len(reached),
                        "time_to_target_s": statistics.median(reached) if reached else None,
                        "shares": [round(w["share"], 2) for w in sorted(done[0][0].get("per_worker") or [],
                                                                         key=lambda w: w["rank"])]})
    return out, curves


def render(results):
    from rich.console import Console
    from rich.table import Table
    console = Console(width=140)
    if "dense" in results:
        t = Table(title="(1) dense MLP 784-512-512-10, 2 workers: parameter server vs all-reduce")
        for c in ("configuration", "samples/s", "vs all-reduce", "target"):
            t.add_column(c)
        for r in results["dense"]:
            t.add_row(r["config"], f"{r['samples_per_s']:,.0f}", f"{r['vs_allreduce']:.2f}x",
                      "" if r["config"] == "all-reduce" else ">= 0.70x")
        console.print(t)
    if "sparse" in results:
        t = Table(title="(2) recsys: 1M x 64 embedding table, Zipf ids, 2 workers")
        for c in ("configuration", "samples/s", "vs all-reduce", "bytes/step/worker", "fewer bytes", "target"):
            t.add_column(c)
        for r in results["sparse"]:
            dense = r["config"].startswith("all-reduce")
            t.add_row(r["config"], f"{r['samples_per_s']:,.0f}", f"{r['vs_allreduce']:.1f}x",
                      f"{r['bytes_per_step'] / 1e6:,.3f} MB", f"{r['fewer_bytes']:,.0f}x",
                      "" if dense else ">= 5x, >= 50x")
        console.print(t)
    if "consistency" in results:
        t = Table(title="(3) gpt, 3 workers, 1 server: BSP vs ASP vs SSP under slow workers (with several runs "
                        "per mode, xN: median samples/s, mean loss and its range over the runs)")
        for c in ("slowdown", "mode", "samples/s", "vs BSP", "eval loss", "vs BSP loss", "time to target", "shares"):
            t.add_column(c)
        for r in results["consistency"]:
            tt = r["time_to_target_s"]
            n, spread = r.get("runs", 1), r.get("loss_vs_bsp_runs") or [r["loss_vs_bsp"]]
            loss_cell = f"{r['loss_vs_bsp']:+.1%}" + (f" ({min(spread):+.1%}..{max(spread):+.1%})" if n > 1 else "")
            reached = f", {r.get('reached_target', 1)}/{n} runs" if n > 1 else ""
            t.add_row(r["slowdown"], r["mode"] + (f" x{n}" if n > 1 else ""), f"{r['samples_per_s']:,.0f}",
                      f"{r['vs_bsp']:.2f}x", f"{r['final_eval_loss']:.3f}" if r["final_eval_loss"] else "-",
                      loss_cell,
                      f"{tt:.1f} s (loss {r['target_loss']:.2f}{reached})" if tt is not None else "not reached",
                      " / ".join(f"{x:.0%}" for x in r["shares"]))
        console.print(t)


def plot(path, curves):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (slow_name, _) in zip(axes, SLOWDOWNS):
        for name, curve in curves.items():
            if name.startswith(slow_name):
                pts = smoothed(curve)
                ax.plot([t for t, _ in pts], [loss for _, loss in pts], label=name.split(" / ")[1])
        ax.set_title(f"gpt, 3 workers, {slow_name}")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("training loss (20-step moving average, rank 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    args = parser().parse_args(argv)
    tables = {t.strip() for t in args.tables.split(",")}
    if args.quick:
        args.repeats = 1
    results, curves = {}, {}
    with tempfile.TemporaryDirectory(prefix="paratrain-ps-bench-") as runs:
        if "1" in tables:
            results["dense"] = table_dense(args, runs)
        if "2" in tables:
            results["sparse"] = table_sparse(args, runs)
        if "3" in tables:
            results["consistency"], curves = table_consistency(args, runs)
    render(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "parameter_server_quick" if args.quick else "parameter_server"
    if curves:
        results["plot"] = plot(str(out / f"{name}.png"), curves)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / (name + '.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
