"""``paratrain bench collectives``: paratrain's shared-memory engine beside Gloo and Open MPI.

    paratrain bench collectives -n 2                      # all_reduce, all_gather, reduce_scatter; 4 KiB..64 MiB
    paratrain bench collectives --algorithms ring,tree,naive   # + paratrain's other all_reduce algorithms
    paratrain bench collectives -n 4 --hierarchical       # + a run with 2 pretend hosts
    python benchmarks/collectives.py --quick              # the same, small and fast

Why this shape: absolute times on a shared 2-core machine drift with whatever
else runs, so the three engines are measured in the same processes, in the
same run, interleaved round by round, and the report leads with ratios
(ARCHITECTURE.md, "A benchmark compares side by side in one run"). The
reporting follows nccl-tests so the numbers read like the ones people know.
Open MPI is asked to yield while it waits (launcher.py says why); the
environment, load average and every round's time go to the JSON, so a
surprising number can be traced.

This module is the parent: it parses options, starts the workers
(launcher.py; each runs collectives_worker.py), and hands rank 0's raw times to
report.py. ``--worker`` is how a started worker enters.
"""
import argparse
import datetime
import json
import os
import platform
import socket
import sys
import tempfile
from pathlib import Path

from ..comm.env import size_bytes
from ..launch import binding
from ..train.argtypes import positive_float, positive_int
from . import launcher, report
from .cases import COLLECTIVES, elements

DEFAULT_SIZES = "4K,64K,1M,16M,64M"
QUICK_SIZES = "4K,64K,1M"
DEFAULT_COLLECTIVES = "all_reduce,all_gather,reduce_scatter"
ALGORITHMS = ("direct", "ring", "tree", "naive")
OP_TIMEOUT = 120  # seconds any single collective may take inside a worker before it raises


def parse_size(text):
    """A --sizes entry (comm.env.size_bytes: "4K", "1M", "16MiB", ...)."""
    try:
        return size_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_list(text, allowed, what):
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad or text!r}; choose from {', '.join(allowed)}")
    return items


def default_iters(nbytes):
    """Rounds per size: ~2 GiB through each engine, between 20 and 300 rounds.
    Small sizes get many rounds (their times are noisy and cheap), 64 MiB gets 32,
    so every size gets the same bytes and the whole run stays short."""
    return max(20, min(300, (2 << 30) // max(1, nbytes)))


CALLS_BELOW = 1024 * 1024   # sizes up to this make several back-to-back calls per timed turn


def default_calls(nbytes):
    """Back-to-back calls per timed turn: 10 up to 1 MiB, whose calls are no longer
    than a CPU's wake-up from sleep after the engine before (collectives_worker.py), 1 above;
    with one call per turn, both engines would time mostly their wake-up."""
    return 10 if nbytes <= CALLS_BELOW else 1


def parser():
    p = argparse.ArgumentParser(
        prog="paratrain bench collectives",
        description="Collective benchmark, nccl-tests style: paratrain shm beside Gloo and Open MPI, "
                    "interleaved in one run, medians and busbw ratios.")
    p.add_argument("-n", "--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--collectives", default=DEFAULT_COLLECTIVES,
                   type=lambda s: parse_list(s, COLLECTIVES, "collective"),
                   help=f"comma list from {','.join(COLLECTIVES)} (default {DEFAULT_COLLECTIVES})")
    p.add_argument("--sizes", default=None, type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
                   help=f"whole-buffer sizes in bytes, K/M/G suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="rounds per size (default: by size, 300 up to 1 MiB, 128 at 16 MiB, 32 at 64 MiB)")
    p.add_argument("--interleave-sizes", action="store_true",
                   help="each round times every size in turn, instead of one size's rounds after another: "
                        "the sizes then see the same host when its speed moves (calibrating a link)")
    p.add_argument("--calls", type=positive_int, default=None,
                   help="back-to-back calls per engine in each timed turn, the time divided by them "
                        f"(default: 10 up to {CALLS_BELOW // 1024} KiB, 1 above)")
    p.add_argument("--warmup", type=positive_int, default=None, help="untimed calls per engine and size, the first "
                   "checked against numpy (default 2)")
    p.add_argument("--algorithms", default="", type=lambda s: parse_list(s, ALGORITHMS, "algorithm") if s else [],
                   help="extra paratrain all_reduce algorithms to measure beside the default one, "
                        f"from {','.join(ALGORITHMS)} (e.g. ring,tree,naive)")
    p.add_argument("--buffers", choices=("private", "shared"), default="private",
                   help="where every engine's buffers live: private process memory (default), or paratrain's "
                        "g.empty_shared memory, from which paratrain's shm engine reads peers' data in place "
                        "(Gloo and MPI use the same buffers as ordinary memory)")
    p.add_argument("--no-mpi", action="store_true", help="leave Open MPI out")
    p.add_argument("--no-gloo", action="store_true", help="leave Gloo out")
    p.add_argument("--bind-to", "--bind_to", dest="bind_to", choices=binding.MODES, default="none",
                   help="pin rank i to CPU i for every engine (core: mpirun --bind-to core, or what "
                        "paratrain run --bind-to core does), or let the kernel place the ranks (none, the default)")
    p.add_argument("--hierarchical", action="store_true",
                   help="add a separate run of paratrain's hierarchical backend with 2 pretend hosts")
    p.add_argument("--out", default="benchmarks/results", help="directory for collectives.json/.png "
                   "(default benchmarks/results)")
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 5 rounds: a smoke test")
    p.add_argument("--timeout", type=positive_float, default=None,
                   help="seconds the whole run may take before the workers are killed (default: estimated)")
    return p


def estimate_seconds(sizes, iters, warmup, collectives, n_engines, nproc):
    """A pessimistic guess of a run's length (0.1 GB/s, 2 ms per call, slower when
    ranks outnumber cores), only to set a deadline that a healthy run never meets."""
    oversub = max(1.0, nproc / (os.cpu_count() or 1))
    per_size = sum((it * default_calls(b) + warmup) * (2e-3 + 2 * b / 1e8) for b, it in zip(sizes, iters))
    return 30 + len(collectives) * n_engines * per_size * oversub


def _run(args, cfg, use_mpi, tmp, tag, timeout, extra_env=None):
    """Start one set of workers on cfg; returns rank 0's result dict (or raises)."""
    cfg = dict(cfg, result=str(Path(tmp) / f"result-{tag}.json"))
    cfg_path = Path(tmp) / f"config-{tag}.json"
    cfg_path.write_text(json.dumps(cfg))
    env = launcher.worker_env(launcher.free_port(), dict(extra_env or {}, PARATRAIN_TIMEOUT=str(OP_TIMEOUT)))
    how = "mpirun" if use_mpi else "subprocesses"
    print(f"[bench] {tag} run: {args.nproc} ranks via {how}, engines {', '.join(cfg['engines'])}"
          f"{' (hierarchical, 2 pretend hosts)' if cfg['hierarchical'] else ''}"
          f"{', rank i pinned to CPU i' if args.bind_to == 'core' else ''}; deadline {timeout:.0f} s",
          file=sys.stderr, flush=True)
    code = launcher.wait(launcher.start(args.nproc, [str(cfg_path)], env, use_mpi, bind_to=args.bind_to), timeout)
    if code != 0:
        raise RuntimeError(f"the {tag} run's workers failed (exit code {code}); their errors are above")
    return json.loads(Path(cfg["result"]).read_text())


def _environment(args, info, launched_with):
    import numpy
    import torch
    import paratrain
    env = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               world_size=args.nproc, cpu_count=os.cpu_count(), host=socket.gethostname(),
               platform=platform.platform(), python=platform.python_version(), torch=torch.__version__,
               numpy=numpy.__version__, paratrain=paratrain.__version__, launcher=launched_with,
               torch_threads_per_rank=info.get("torch_threads"), mpi_library=info.get("mpi_library"),
               paratrain_default_algorithm=info.get("default_algorithm"),
               bind_to=args.bind_to, cpus_per_rank=info.get("cpus_per_rank"))
    try:
        import mpi4py
        env["mpi4py"] = mpi4py.__version__
    except ImportError:
        pass
    return env


def bench(args):
    if args.nproc < 2:
        print("paratrain bench collectives: -n must be at least 2 (busbw of one rank is zero)", file=sys.stderr)
        return 2
    sizes = args.sizes or [parse_size(s) for s in (QUICK_SIZES if args.quick else DEFAULT_SIZES).split(",")]
    sizes = sorted({elements(s, args.nproc) * 4 for s in sizes})
    iters = [args.iters or (5 if args.quick else default_iters(s)) for s in sizes]
    calls = [args.calls or default_calls(s) for s in sizes]
    warmup = args.warmup or 2
    notes = []
    engines = ["paratrain"] + ([] if args.no_gloo else ["gloo"])
    use_mpi = not args.no_mpi and launcher.mpi_available()
    if use_mpi:
        engines.append("mpi")
        notes.append(f"Open MPI ran with {launcher.MPI_YIELD}={os.environ.get(launcher.MPI_YIELD, '1')} "
                     "(1 = yield while waiting instead of busy-polling; set it in the environment to change)")
    elif not args.no_mpi:
        notes.append("Open MPI left out: no mpirun next to this Python or on PATH, or mpi4py is not installed.")
    cfg = dict(collectives=args.collectives, sizes=sizes, iters=iters, calls=calls, warmup=warmup, engines=engines,
               algorithms=args.algorithms, hierarchical=False, hosts=2, op_timeout=OP_TIMEOUT,
               buffers=args.buffers, interleave_sizes=args.interleave_sizes)
    n_eng = len(engines) + len(args.algorithms)
    timeout = args.timeout or 2 * estimate_seconds(sizes, iters, warmup, args.collectives, n_eng, args.nproc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rows, failed = [], False
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-") as tmp:
        main_res = _run(args, cfg, use_mpi, tmp, "main", timeout)
        rows += main_res["rows"]
        if args.hierarchical:
            hcfg = dict(cfg, engines=["paratrain-hier"], algorithms=[], hierarchical=True)
            htime = args.timeout or 2 * estimate_seconds(sizes, iters, warmup, args.collectives, 1, args.nproc)
            try:
                hres = _run(args, hcfg, False, tmp, "hierarchical", htime)
                rows += [dict(r, run="hierarchical") for r in hres["rows"]]
                notes.append("pt hier (2 hosts): paratrain backend='hierarchical' with PARATRAIN_PRETEND_HOSTS=2 "
                             "(shm inside a pretend host, Gloo between leaders; all_gather/reduce_scatter go flat "
                             "over Gloo), measured in a separate run after the main one, not interleaved.")
            except (RuntimeError, launcher.BenchTimeout) as e:
                failed = True
                notes.append(f"the hierarchical run failed: {e}")

    load_after = os.getloadavg()
    notes.append(f"load average (1, 5, 15 min) before: {_load(load_before)}, after: {_load(load_after)} "
                 f"(the benchmark's own {args.nproc} ranks count towards 'after'; more means the machine was shared)")
    results = report.summarize(rows, args.nproc)
    for r in results:
        if r["note"]:
            notes.append(f"* {r['engine']} {r['collective']}: {r['note']}")
    notes = list(dict.fromkeys(notes))
    report.print_report(results, args.nproc, os.cpu_count(), notes, console=_console())
    meta = dict(benchmark="collectives",
                environment=dict(_environment(args, main_res["info"], "mpirun" if use_mpi else "subprocesses"),
                                 loadavg_before=list(load_before), loadavg_after=list(load_after),
                                 mpi_yield_when_idle=os.environ.get(launcher.MPI_YIELD, "1") if use_mpi else None),
                config=dict(nproc=args.nproc, collectives=args.collectives, sizes=sizes, iters=iters, calls=calls,
                            warmup=warmup, engines=engines, algorithms=args.algorithms,
                            hierarchical=args.hierarchical, dtype="float32", buffers=args.buffers,
                            bind_to=args.bind_to, interleave_sizes=args.interleave_sizes),
                conventions=report.HEADER, notes=notes)
    json_path, png_path = out / "collectives.json", out / "collectives.png"
    report.write_json(json_path, results, meta)
    report.plot(png_path, results, args.nproc)
    print(f"wrote {json_path}\nwrote {png_path}")
    return 1 if failed or not all(r["verified"] for r in results) else 0


def _load(avg):
    return ", ".join(f"{x:.2f}" for x in avg)


def _console():
    """Wide enough for the table when the output is a file or a pipe (rich would assume 80 columns and squeeze it)."""
    from rich.console import Console
    return Console() if sys.stdout.isatty() else Console(width=250)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        from .collectives_worker import main as worker_main
        return worker_main(argv[1:])
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help, or a bad option (argparse printed why): a code, not an exit
        return e.code if isinstance(e.code, int) else 2
    try:
        return bench(args)
    except (RuntimeError, launcher.BenchTimeout) as e:
        print(f"paratrain bench collectives: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
