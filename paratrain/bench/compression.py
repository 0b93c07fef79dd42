"""When does gradient compression pay? paratrain's compressors beside DDP's, over 1 Gbit/s, 10 Gbit/s and no limit.

    paratrain bench compression [--links 1gbit,10gbit,unlimited] [--rounds 6] [--steps 10] [--quick]
    python benchmarks/compression.py            (the same)

The setting: the ``mlp-large`` task (21M parameters, 84 MB of
fp32 gradients a step), 2 pretend hosts x 1 worker joined by a link limited
with ``paratrain run --link RATE`` (launch/link.py; needs root), or by
nothing but the loopback. Every engine runs in the same 2 processes, round
by round (compression_worker.py): our DataParallel uncompressed, with fp16,
top-k 1%, PowerSGD rank 4 and 1-bit, and torch's DDP plain and with its
``fp16_compress_hook``. Their accuracy comes from a separate, longer run
(``--accuracy-steps``, default 400: the task's 100 steps are too few for
error feedback to catch up): each of our engines trains that many steps on
the same batches, then is scored on the task's test set, so the difference
is what its compression cost; once for each of ``--accuracy-seeds`` (default
0, 1, 2), and the table shows the mean and each. The numbers do not depend
on the link, so that run has none.

torch's ``powerSGD_hook`` is tried on its own first (it aborts on Gloo with
torch 2.13): the table says whether it ran and, if not, how it failed.

Prints per link: ms/step, samples/s, the ratio to uncompressed all-reduce
and to DDP, MB a rank sends per step and their share of fp32's (in the
timed steps, which are past top-k's density warm-up, and over the whole
accuracy run, warm-up included), the test
accuracy after the same steps and its distance to uncompressed; and the
goals at 1 Gbit/s (top-k and PowerSGD: at least 3x, at most 5% of the
bytes, within 1 accuracy point). Writes benchmarks/results/compression.json
and compression.png.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..train.argtypes import positive_int
from . import gpt_runs, launcher

ENGINES = ["pt/none", "pt/fp16", "pt/topk:0.01", "pt/powersgd:4", "pt/onebit", "torch/ddp", "torch/ddp+fp16"]
ACCURACY_ENGINES = ["pt/none", "pt/fp16", "pt/topk:0.01", "pt/powersgd:4", "pt/onebit"]
GOAL_ENGINES = ("pt/topk:0.01", "pt/powersgd:4")
GOAL_SPEEDUP, GOAL_BYTES, GOAL_POINTS = 3.0, 0.05, 1.0
UNLIMITED = "unlimited"


def parser():
    p = argparse.ArgumentParser(prog="paratrain bench compression",
                                description="gradient compression vs DDP over pretend hosts joined by a slow link")
    p.add_argument("--links", default="1gbit,10gbit,unlimited",
                   help="link rates between the 2 pretend hosts, comma-separated (tc's words, or 'unlimited')")
    p.add_argument("--engines", default=",".join(ENGINES), help="engines, comma-separated")
    p.add_argument("--accuracy-steps", type=positive_int, default=400,
                   help="steps each of our engines trains in the accuracy run, then scored (default 400)")
    p.add_argument("--accuracy-engines", default=",".join(ACCURACY_ENGINES),
                   help="engines of the accuracy run, comma-separated")
    p.add_argument("--accuracy-seeds", default="0,1,2",
                   help="seeds (initial weights and batches) of the accuracy run, comma-separated; the table "
                        "shows each engine's mean over them (default 0,1,2)")
    p.add_argument("--no-torch-powersgd", action="store_true", help="skip trying torch's powerSGD_hook")
    gpt_runs.add_common_options(p)
    p.set_defaults(rounds=5, steps=4)
    return p


def launch_command(link, cfg_path):
    """``paratrain run`` for 2 pretend hosts x 1 worker: in a limited namespace, or on the plain loopback."""
    run = [sys.executable, "-m", "paratrain.run"]
    worker = ["-m", "paratrain.bench.compression_worker", str(cfg_path)]
    if link == UNLIMITED:
        return run + ["-n", "2"] + worker, {"PARATRAIN_PRETEND_HOSTS": "2"}
    return run + ["--link", link, "--nnodes", "2", "-n", "1"] + worker, {}


def run_link(link, engines, args, folder, capture=False, name=None, seed=0, steady=True):
    """One launch of the workers at ``link``: their result, or (capture) the exit code and output.
    ``steady``: the timed steps are past top-k's density warm-up (compression_worker.py)."""
    name = name or f"{link}-{len(engines)}"
    cfg = dict(engines=engines, rounds=args.rounds, steps=args.steps, warmup=args.warmup, batch=32,
               timeout=args.timeout, result=str(Path(folder) / f"result-{name}.json"), seed=seed, steady=steady)
    path = Path(folder) / f"cfg-{name}.json"
    path.write_text(json.dumps(cfg))
    cmd, extra = launch_command(link, path)
    env = dict(os.environ, PARATRAIN_TIMEOUT=str(args.timeout), OMP_NUM_THREADS="1", **extra)
    print(f"[bench] link {link}: {', '.join(engines)}", file=sys.stderr, flush=True)
    if capture:
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 60)
        except subprocess.TimeoutExpired:
            return None, f"did not finish within {args.timeout:.0f} s"
        return done.returncode, done.stdout + done.stderr
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    code = launcher.wait([proc], args.timeout)
    if code != 0:
        raise RuntimeError(f"the run at link {link} failed (exit code {code}); its errors are above")
    return json.loads(Path(cfg["result"]).read_text())


def probe_torch_powersgd(args, folder):
    """Does DDP's powerSGD_hook (rank 4) run here? {ran, why}: why is its first error line."""
    # a short timeout: when one rank aborts, the other may wait in Gloo until it runs out
    probe = argparse.Namespace(**dict(vars(args), rounds=1, steps=2, warmup=2, timeout=min(args.timeout, 60)))
    code, out = run_link(UNLIMITED, ["torch/ddp+powersgd"], probe, folder, capture=True)
    if code == 0:
        return dict(ran=True, why="ran 4 steps")
    lines = [ln for ln in (out or "").splitlines() if re.search(r"enforce fail|Error|error|killed", ln)]
    why = next((ln for ln in lines if "enforce fail" in ln), lines[-1] if lines else f"exit code {code}")
    why = re.sub(r"^\[rank \d+\]\s*(\[rank\d+\]:\s*)?", "", why).strip()
    return dict(ran=False, why=why[:300], exit_code=code)


def accuracy_run(args, folder):
    """Each of ``--accuracy-engines`` trains ``--accuracy-steps`` steps on the same batches
    (no link limit: the numbers do not depend on the link), then is scored on the task's
    test set; once per seed of ``--accuracy-seeds``. {engine: its worker report, with
    ``accuracy`` the mean over the seeds and ``accuracies`` each seed's}.

    Why several seeds: one run's accuracy moves from one evaluation to the next, and
    more with sparse updates, so a single seed cannot tell a compressor's cost from noise."""
    engines = gpt_runs.words(args.accuracy_engines)
    if not engines or args.accuracy_steps < 1:
        return {}
    long = argparse.Namespace(**dict(vars(args), rounds=1, steps=args.accuracy_steps, warmup=0))
    seeds = [int(s) for s in gpt_runs.words(args.accuracy_seeds)] or [0]
    runs = [run_link(UNLIMITED, engines, long, folder, name=f"accuracy-seed{seed}", seed=seed, steady=False)["engines"]
            for seed in seeds]
    scored = {}
    for engine in engines:
        each = [run[engine]["accuracy"] for run in runs]
        scored[engine] = dict(runs[0][engine], accuracy=statistics.mean(each), accuracies=each, seeds=seeds)
    return scored


def summarize(link, result, scored):
    """One row per engine at this link; accuracy from the accuracy run (``scored``)."""
    medians = {e: statistics.median(t) for e, t in result["times"].items()}
    eng = result["engines"]
    base, ddp = medians.get("pt/none"), medians.get("torch/ddp")
    fp32 = eng[next(iter(eng))]["parameters"] * 4
    none_acc = scored["pt/none"]["accuracy"] if "pt/none" in scored else None
    batch = 32 * result["world_size"]
    rows = []
    for name, step in medians.items():
        e, acc = eng[name], scored.get(name, {}).get("accuracy")
        rows.append(dict(link=link, engine=name, step_ms=step * 1e3, samples_per_s=batch / step,
                         vs_none=base / step if base else None, vs_ddp=ddp / step if ddp else None,
                         mb_per_step=e["bytes_per_step"] / 1e6, bytes_share=e["bytes_per_step"] / fp32,
                         run_bytes_share=scored[name]["bytes_per_step"] / fp32 if name in scored else None,
                         accuracy=acc, points=(acc - none_acc) * 100 if acc is not None and none_acc is not None
                         else None, accuracy_steps=scored.get(name, {}).get("steps"),
                         accuracies=scored.get(name, {}).get("accuracies")))
    return rows


def goals(rows):
    """The goals at 1 Gbit/s (the module's note), per engine: {engine: {speedup, bytes, accuracy: bool}}."""
    out = {}
    for r in rows:
        if r["link"] == "1gbit" and r["engine"] in GOAL_ENGINES and r["vs_none"] is not None:
            shares = [r["bytes_share"]] + ([r["run_bytes_share"]] if r.get("run_bytes_share") is not None else [])
            out[r["engine"]] = dict(speedup=r["vs_none"] >= GOAL_SPEEDUP, bytes=max(shares) <= GOAL_BYTES,
                                    accuracy=r["points"] is not None and r["points"] >= -GOAL_POINTS)
    return out


def table(rows, torch_powersgd, accuracy_steps, seeds):
    from rich.table import Table
    t = Table(title=f"mlp-large (21M), 2 pretend hosts x 1 worker: medians of interleaved rounds; test accuracy "
                    f"after {accuracy_steps} steps of each (the accuracy run), mean over seeds {seeds}")
    for c in ("link", "engine", "step ms", "samples/s", "vs none", "vs DDP", "MB/step a rank", "of fp32",
              "of fp32, whole run", "accuracy", "points vs none", "each seed"):
        t.add_column(c, justify="left" if c in ("link", "engine") else "right")
    for r in rows:
        f = (lambda v, fmt: "-" if v is None else fmt.format(v))
        t.add_row(r["link"], r["engine"], f"{r['step_ms']:.0f}", f"{r['samples_per_s']:.1f}",
                  f(r["vs_none"], "{:.2f}x"), f(r["vs_ddp"], "{:.2f}x"), f"{r['mb_per_step']:.2f}",
                  f"{100 * r['bytes_share']:.1f}%", f(r.get("run_bytes_share") and 100 * r["run_bytes_share"],
                                                      "{:.1f}%"),
                  f(r["accuracy"] and 100 * r["accuracy"], "{:.2f}%"),
                  f(r["points"], "{:+.2f}"),
                  " / ".join(f"{100 * a:.2f}" for a in r["accuracies"]) if r.get("accuracies") else "-")
    if torch_powersgd is not None:
        t.caption = ("torch DDP powerSGD_hook (rank 4, Gloo): " +
                     ("ran" if torch_powersgd["ran"] else f"failed: {torch_powersgd['why']}"))
    return t


def plot(path, rows, links):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    width = 0.8 / len(links)
    for i, link in enumerate(links):
        mine = {r["engine"]: r["samples_per_s"] for r in rows if r["link"] == link}
        ax.bar([k + i * width for k in range(len(engines))], [mine.get(e, 0) for e in engines], width, label=link)
    ax.set_xticks([k + width * (len(links) - 1) / 2 for k in range(len(engines))], engines, rotation=25,
                  ha="right", fontsize=8)
    ax.set_ylabel("samples/s (2 workers)")
    ax.legend(title="link between the 2 hosts")
    ax.set_title("Gradient compression: mlp-large 21M, paratrain (pt/) and torch DDP")
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    from ..launch import link as linkmod
    args = parser().parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.accuracy_steps, args.accuracy_seeds = 2, 1, 1, 3, "0"
    engines, links = gpt_runs.words(args.engines), gpt_runs.words(args.links)
    skipped = {}
    for link in links:
        why = None if link == UNLIMITED else linkmod.check(link)
        if why:
            skipped[link] = why
            print(f"[bench] skipping link {link}: {why}", file=sys.stderr)
    links = [x for x in links if x not in skipped]
    if not links:
        print("paratrain bench compression: no link left to measure", file=sys.stderr)
        return 2
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        torch_powersgd = None if args.no_torch_powersgd else probe_torch_powersgd(args, tmp)
        scored = accuracy_run(args, tmp)
        for link in links:
            raw[link] = run_link(link, engines, args, tmp)
            rows += summarize(link, raw[link], scored)
    met = goals(rows)
    out = gpt_runs.show_and_save(table(rows, torch_powersgd, args.accuracy_steps, args.accuracy_seeds), "compression",
                                 dict(task="mlp-large", hosts=2), args, rows, dict(raw, accuracy=scored), links=links,
                                 skipped=skipped, torch_powersgd=torch_powersgd, goals=met,
                                 accuracy_steps=args.accuracy_steps, accuracy_seeds=args.accuracy_seeds)
    for engine, g in met.items():
        print(f"goal at 1gbit, {engine}: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in g.items()))
    png = plot(out / "compression.png", rows, links)
    print(f"wrote {out / 'compression.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
