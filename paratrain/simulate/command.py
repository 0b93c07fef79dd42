"""``paratrain simulate``: a training step predicted for a cluster and a workload, at any worker count.

    paratrain simulate --cluster CLUSTER.toml --workload WORKLOAD.toml --strategy dp --workers 8,64,512
    paratrain simulate ... --json          {"rows": [{"strategy", "workers", "step_ms", "samples_per_s",
                                                      "efficiency", ...}]}
    paratrain simulate --calibrate         fit this machine's links to `paratrain bench collectives`, and store them

Per strategy (``--strategy all``: every one, by paratrain compare's names)
and worker count: the step time and its parts (compute, exposed communication,
a pipeline's bubble, compression's encoding), samples per second, and the scaling efficiency (a device's samples per second
in the job over one device's alone). The formats of the two files: files.py.
"""
import argparse
import json
import os
import sys

from ..train.argtypes import positive_float, positive_int
from . import data_parallel, here
from .files import load_cluster, load_workload
from .step import Unavailable
from .strategies import STRATEGIES, predict


def _workers(text):
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: give worker counts, e.g. 8,64,512")
    return counts


def _rates(text):
    if text.strip() == "none":
        return []
    from ..launch import link
    rates = [x.strip() for x in text.split(",") if x.strip()]
    bad = [link.check(r) for r in rates if link.check(r)]
    if bad or not rates:
        raise argparse.ArgumentTypeError(bad[0] if bad else f"--links {text!r}: give rates such as 1gbit,10gbit")
    return rates


def build_parser():
    p = argparse.ArgumentParser(prog="paratrain simulate", description=__doc__.splitlines()[0])
    p.add_argument("--calibrate", action="store_true",
                   help="measure all_reduce here (paratrain bench collectives at 2-4 ranks), fit each link's alpha, "
                        "beta and gamma, print measured against predicted, and store the fit (--calibration)")
    p.add_argument("--links", default=None, type=_rates, metavar="RATES",
                   help="--calibrate: the links between two pretend hosts to calibrate too, comma-separated in tc's "
                        "words, or none (default 1gbit,10gbit where root and tc allow; paratrain run --link)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help=f"where the fit is stored (default {calibration_path()})")
    p.add_argument("--cluster", metavar="CLUSTER.toml", help="the machines and their links; here: this machine, "
                                                           "its links from --calibrate")
    p.add_argument("--workload", metavar="WORKLOAD.toml", help="the model and its step on one device; or a built-in "
                                                             "model's name (gpt, mlp-large, ...), measured here")
    p.add_argument("--strategy", default="dp", choices=[*STRATEGIES, "all"],
                   help="dp: data parallelism with the all-reduce paratrain would choose (default); all: every "
                        "strategy, side by side")
    p.add_argument("--algorithm", choices=data_parallel.FORCIBLE, default=None,
                   help="force this all-reduce (default: the cheapest by the model)")
    p.add_argument("--bucket-mb", type=positive_float, default=data_parallel.BUCKET_MB,
                   help=f"gradient bucket size (default {data_parallel.BUCKET_MB:g}, pt.DataParallel's)")
    p.add_argument("--stages", type=positive_int, default=None,
                   help="pipeline: stages per replica (default: a host's devices)")
    p.add_argument("--microbatches", type=positive_int, default=4, help="pipeline: micro-batches per step (default 4)")
    p.add_argument("--tp", type=positive_int, default=None,
                   help="tensor: devices per tensor group (default: a host's); pipeline: each stage cut across "
                        "TP devices (3D; default 1)")
    p.add_argument("--servers", type=positive_int, default=None, help="ps-*: parameter servers (default: one a host)")
    p.add_argument("--compression", choices=("topk", "powersgd"), default=None,
                   help="tensor: the replicas of the tensor groups compress their gradients (top-k 1%%, PowerSGD "
                        "rank 4, as paratrain train --tp T --compression)")
    p.add_argument("--workers", type=_workers, default=[1, 8, 64], help="worker counts, comma-separated")
    p.add_argument("--json", action="store_true", help="print {\"rows\": [...]} instead of a table")
    return p


def rows(cluster, workload, strategy, counts, **options):
    """A row per (strategy, workers); ``strategy`` "all" is every one. A strategy that
    cannot run there gets a row with its ``unavailable`` reason and no times."""
    out = []
    for name in (STRATEGIES if strategy == "all" else [strategy]):
        for workers in counts:
            s = predict(name, workload, cluster, workers, **options)
            if isinstance(s, Unavailable):
                out.append({"strategy": name, "workers": workers, "unavailable": str(s)})
                continue
            out.append({"strategy": name, "workers": workers, "step_ms": s.step_s * 1e3,
                        "compute_ms": s.compute_s * 1e3, "exposed_comm_ms": s.exposed_s * 1e3,
                        "bubble_ms": s.bubble_s * 1e3, "extra_ms": s.extra_s * 1e3, "comm_ms": s.comm_s * 1e3,
                        "samples_per_s": s.samples_per_s, "efficiency": s.efficiency, "how": s.how})
    return out


def calibration_path():
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "paratrain", "calibration.json")


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def _rows(name, samples, errors):
    """Calibration rows of one link: each sample with its prediction."""
    return [{"link": name, "algorithm": algorithm, "ranks": P, "bytes": n, "measured_s": seconds,
             "predicted_s": seconds * (1 + float(error)), "error": float(error)}
            for (algorithm, P, n, seconds), error in zip(samples, errors)]


def calibrate_here(path, rates=None):
    """--calibrate: measure, fit, show the fit's errors, store it. ``rates``: the pretend
    links to calibrate too (None: calibrate.LINK_RATES where this machine can make them)."""
    from . import calibrate
    from ..launch import link as linkmod
    print("paratrain simulate: measuring all_reduce here (paratrain bench collectives, 2, 3 and 4 ranks)...",
          flush=True)
    cores = os.cpu_count()
    samples = calibrate.by_regime(calibrate.measure_here(), cores)
    links = calibrate.fit_links(samples, cores)
    rows, summary = [], []
    for name, rows_of in samples.items():
        link, contention = links[name]
        rows += _rows(name, rows_of, calibrate.relative_errors(link, rows_of, cores, contention))
        held = calibrate.held_out_errors(rows_of, cores)
        if held:
            summary.append(f"{name}: each size of 1 MiB and above fitted without it, predicting it: median "
                           f"{_median(held):.1%}, max {max(held):.1%}")
    if rates is None:
        rates = [r for r in calibrate.LINK_RATES if linkmod.check(r) is None]
        if len(rates) < len(calibrate.LINK_RATES):
            print(f"paratrain simulate: pretend hosts left out: {linkmod.check(calibrate.LINK_RATES[0])}")
    intra_name = calibrate.link_for_ranks(links, "shm_direct", 4, cores)   # the pretend hosts' 2 x 2 ranks
    intra, intra_k = links[intra_name]
    for rate in rates:
        print(f"paratrain simulate: measuring two pretend hosts joined by {rate} (Gloo between them; "
              "the hierarchical backend at 2 x 2 ranks)...", flush=True)
        got = calibrate.measure_link(rate)
        net = calibrate.fit_network(got["net"])
        links[f"net_{rate}"] = (net, 1.0)
        errors = calibrate.link_errors(got, net, intra, cores, intra_k)
        rows += _rows(f"net_{rate}", got["net"], errors["net"])
        rows += _rows(f"net_{rate}", got.get("hierarchical", []), errors["hierarchical"])
        held = [abs(e) for (_, _, n, _), e in zip(got.get("hierarchical", []), errors["hierarchical"])
                if n >= 1 << 20]
        if held:
            summary.append(f"net_{rate}: hierarchical 2 x 2 ranks, predicted from the link and {intra_name} "
                           f"(not fitted on them): median {_median(held):.1%}, max {max(held):.1%}")
    from rich.console import Console
    from rich.table import Table
    t = Table(title="all_reduce here: measured against the fitted model")
    for name in ("link", "algorithm", "ranks", "bytes", "measured", "predicted", "error"):
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(r["link"], r["algorithm"], str(r["ranks"]), f"{r['bytes']:,}", f"{r['measured_s'] * 1e3:.3f} ms",
                  f"{r['predicted_s'] * 1e3:.3f} ms", f"{r['error']:+.1%}")
    Console(width=max(Console().width, 100)).print(t)
    for name in links:
        large = [abs(r["error"]) for r in rows if r["link"] == name and r["bytes"] >= 1 << 20]
        if large:
            print(f"{name}: |error| at 1 MiB and above: median {_median(large):.1%}, max {max(large):.1%}")
    for line in summary:
        print(line)
    for name, (link, contention) in links.items():
        rate = 8 / link.beta / 1e9 if link.beta else float("inf")
        far = (f"; past {link.cache_bytes / 1024:.0f} KiB, {link.beyond * 1e9:.4f} ns/byte more"
               + (" for every byte" if link.cliff else " for the bytes past it") if link.cache_bytes else "")
        far += f"; a call takes at least {link.floor * 1e3:.2f} ms" if link.floor else ""
        shared = any(P > cores for _, P, _, _ in samples.get(name, ()))
        print(f"{name}: alpha {link.alpha * 1e6:.2f} us, beta {link.beta * 1e9:.4f} ns/byte ({rate:.1f} Gbit/s), "
              f"gamma {link.gamma * 1e9:.4f} ns/byte{far}"
              + (f"; ranks sharing cores: ceil(P/cores) (P/cores)^{contention - 1:g}" if shared else ""))
    from . import crowding
    print(f"paratrain simulate: measuring a synchronization of {2 * cores} processes on the {cores} cores...",
          flush=True)
    crowded, points = crowding.measure(cores)
    print("synchronizing more ranks than cores: " + ", ".join(f"+{extra * 1e3:.2f} ms after {w * 1e3:g} ms of work"
                                                              for w, extra in points)
          + f"; fitted {crowded.base_s * 1e3:.2f} ms + {crowded.per_work:.2f} x the work")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"links": {name: vars(link) for name, (link, _) in links.items()}, "cores": cores,
                   "contention": {name: k for name, (_, k) in links.items()}, "crowding": vars(crowded),
                   "samples": rows, "crowding_points": points}, f, indent=1)
    print(f"wrote {path}")
    return 0


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.calibrate:
        return calibrate_here(args.calibration or calibration_path(), args.links)
    if args.cluster is None or args.workload is None:
        parser.error("give --cluster and --workload (or --calibrate)")
    if args.compression and args.strategy not in ("tensor", "all"):
        parser.error(f"--compression is for --strategy tensor (its replicas' gradients); for data parallelism "
                     f"compressed, give --strategy {args.compression}")
    try:
        cluster = here.cluster_here(args.calibration or calibration_path()) if args.cluster == "here" \
            else load_cluster(args.cluster)
        workload = load_workload(args.workload)
        table = rows(cluster, workload, args.strategy, args.workers, algorithm=args.algorithm,
                     bucket_mb=args.bucket_mb, stages=args.stages, microbatches=args.microbatches, tp=args.tp,
                     servers=args.servers, compression=args.compression)
    except ValueError as e:
        print(f"paratrain simulate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"cluster": cluster.name, "workload": workload.name, "rows": table}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"{workload.name} on {cluster.name}: {args.strategy}")
    for name in ("strategy", "workers", "step", "compute", "exposed comm", "bubble", "encoding", "samples/s",
                 "efficiency"):
        t.add_column(name, justify="right")
    t.add_column("how", justify="left")
    for r in table:
        if "unavailable" in r:
            t.add_row(r["strategy"], str(r["workers"]), *["-"] * 7, r["unavailable"])
            continue
        t.add_row(r["strategy"], str(r["workers"]), *(f"{r[k]:.1f} ms" for k in
                                                      ("step_ms", "compute_ms", "exposed_comm_ms", "bubble_ms",
                                                       "extra_ms")),
                  f"{r['samples_per_s']:,.0f}", f"{r['efficiency']:.1%}", r["how"])
    Console(width=max(Console().width, 150)).print(t)
    return 0
