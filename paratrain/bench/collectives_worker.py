"""One worker of the collectives benchmark: every engine in this process, measured round by round.

Method (nccl-tests' conventions, adapted to engines of very different speeds):

- For each collective and size, the engines share one set of buffers. Each
  engine first gets ``warmup`` untimed calls, the first of which is checked
  against numpy (cases.py), so a fast wrong answer is reported as WRONG.
- Then ``iters`` rounds; in each round every engine makes one timed call,
  in turn. The turn order rotates by one each round, so no engine always runs
  first after the gather (or always right after a given rival) and drift on a
  busy machine hits all engines alike.
- A timed turn is: restore the input, the engine's own barrier, then
  perf_counter around ``calls`` back-to-back calls, divided by ``calls``. The
  barrier lines the ranks up; the round's time is the *slowest* rank's (a
  collective is done when the last rank is done), gathered after the size is
  finished, and the reported figure is the median over rounds (computed in
  report.py).
- ``--interleave-sizes``: the rounds go over every size instead, round i a
  turn of every engine at every size, so that on a shared host whose speed
  moves within seconds the sizes see the same host (a link's alpha and beta
  come from the sizes' differences); each size's calls then find the caches
  the other sizes left.
- Small sizes make several calls per turn (collectives.default_calls), as
  nccl-tests and the OSU benchmarks time a loop of calls: a CPU that has just
  slept runs slower for a while, so with one call per turn an engine's
  small-message time would measure the wake-up left by the engine before it
  (Gloo blocks in the kernel) more than its own latency. A loop shows each
  engine's own latency, whether it keeps the CPU awake or not; the turns stay
  interleaved.

Rank 0 writes every round's max-over-ranks time to the result JSON; the
parent turns them into medians, bandwidths, ratios, a table and a plot.
"""
import json
import os
import sys
import time

import numpy as np
import torch

from .cases import Case
from .engines import Gloo, Mpi, Paratrain, gather_to_all


def _timed(engine, case, calls):
    case.reset()
    engine.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        case.call(engine)
    return (time.perf_counter() - t0) / calls


def _engines(cfg, group, mpi):
    """(engines for every collective, extra paratrain algorithms for all_reduce only)."""
    if cfg["hierarchical"]:
        return [Paratrain(group, name="paratrain-hier")], []
    base = [Paratrain(group)]
    if "gloo" in cfg["engines"]:
        base.append(Gloo(group, os.environ.get("MASTER_ADDR", "127.0.0.1"), cfg["op_timeout"]))
    if mpi is not None:
        base.append(mpi)
    default = group.default_algorithm(1)
    extra = [Paratrain(group, a, name=f"paratrain/{a}") for a in cfg["algorithms"] if a != default]
    return base, extra


def _warm(case, engines, warmup):
    """Each engine's untimed calls, the first checked: one check per engine (1.0 right)."""
    ok = []
    for e in engines:
        ok.append(case.check(e))
        for _ in range(warmup - 1):
            case.reset()
            case.call(e)
    return np.array(ok, dtype=np.float64)


def _round(case, engines, i, calls, times):
    """Round ``i``: a timed turn of every engine, the order rotated by the round."""
    E = len(engines)
    for k in range(E):
        j = (i + k) % E
        times[j, i] = _timed(engines[j], case, calls)


def _measure(case, engines, iters, warmup, calls):
    """(times: engines x iters seconds on this rank, ok: one check per engine)."""
    ok = _warm(case, engines, warmup)
    times = np.empty((len(engines), iters))
    for i in range(iters):
        _round(case, engines, i, calls, times)
    return times, ok


def _measure_interleaved(cases, engines, iters, warmup, calls):
    """``_measure`` of every size at once: round i is a turn of every engine at every size
    (the sizes' order rotated too), so a slow stretch of a shared host falls on every size
    alike instead of on the one being measured then. [(times, ok)] in the cases' order."""
    out = [(np.empty((len(engines), n)), _warm(case, engines, warmup)) for case, n in zip(cases, iters)]
    S = len(cases)
    for i in range(max(iters)):
        for k in range(S):
            s = (i + k) % S
            if i < iters[s]:
                _round(cases[s], engines, i, calls[s], out[s][0])
    return out


def _progress(rank, text):
    if rank == 0:
        print(text, file=sys.stderr, flush=True)


def run(cfg):
    torch.set_num_threads(1)
    mpi = Mpi() if "mpi" in cfg["engines"] and not cfg["hierarchical"] else None
    import paratrain as pt
    if cfg["hierarchical"]:
        os.environ["PARATRAIN_PRETEND_HOSTS"] = str(cfg["hosts"])
        group = pt.init(backend="hierarchical", timeout=cfg["op_timeout"])
    else:
        group = pt.init(backend="shm", timeout=cfg["op_timeout"])
    P, rank = group.world_size, group.rank
    if mpi is not None and (mpi.comm.rank, mpi.comm.size) != (rank, P):
        raise RuntimeError(f"MPI says rank {mpi.comm.rank} of {mpi.comm.size}, paratrain says {rank} of {P}")
    base, extra = _engines(cfg, group, mpi)
    alloc = None
    if cfg.get("buffers") == "shared":
        alloc = lambda n: group.empty_shared(n).numpy()  # noqa: E731  (zero-filled float32)
    _progress(rank, f"[bench] {P} ranks up: {', '.join(e.name for e in base + extra)}")

    rows = []
    for coll in cfg["collectives"]:
        engines = base + (extra if coll == "all_reduce" else [])
        measured = None
        if cfg.get("interleave_sizes"):
            cases = [Case(coll, nbytes, P, rank, alloc) for nbytes in cfg["sizes"]]
            measured = iter(_measure_interleaved(cases, engines, cfg["iters"], cfg["warmup"], cfg["calls"]))
        for nbytes, iters, calls in zip(cfg["sizes"], cfg["iters"], cfg["calls"]):
            if measured is None:
                case = Case(coll, nbytes, P, rank, alloc)
                times, ok = _measure(case, engines, iters, cfg["warmup"], calls)
            else:
                case = cases.pop(0)
                times, ok = next(measured)
            everyone = gather_to_all(group, np.concatenate([times.ravel(), ok]))
            slowest = everyone[:, :times.size].max(axis=0).reshape(times.shape)
            verified = everyone[:, times.size:].min(axis=0) > 0
            if rank == 0:
                for j, e in enumerate(engines):
                    rows.append(dict(collective=coll, engine=e.name, bytes=case.nbytes, count=case.count,
                                     iters=iters, calls=calls, verified=bool(verified[j]), note=e.notes.get(coll, ""),
                                     samples_s=slowest[j].tolist()))
                med = ", ".join(f"{e.name} {np.median(slowest[j]) * 1e6:,.0f} us" + ("" if verified[j] else " WRONG")
                                for j, e in enumerate(engines))
                _progress(rank, f"[bench] {coll:<14} {case.nbytes:>11,} B x {iters:>3}: {med}")
            del case

    cpus = _cpus_per_rank(group)
    if rank == 0:
        info = dict(world_size=P, backend=group.backend, default_algorithm=base[0].g.default_algorithm(1),
                    mpi_library=mpi.library_version() if mpi is not None else None,
                    torch_threads=torch.get_num_threads(), cpus_per_rank=cpus)
        with open(cfg["result"], "w") as f:
            json.dump(dict(info=info, rows=rows), f)
    group.barrier()
    for e in base:
        if isinstance(e, Gloo):
            e.close()
    pt.destroy()
    return 0


def _cpus_per_rank(group):
    """Every rank's CPU affinity (what --bind-to did), for the JSON."""
    mask = np.zeros(os.cpu_count())   # the same length on every rank: they share this host
    mask[sorted(os.sched_getaffinity(0))] = 1
    return [np.flatnonzero(row).tolist() for row in gather_to_all(group, mask)]


def main(argv):
    """``python -m paratrain.bench.collectives --worker CONFIG.json``"""
    if len(argv) != 1:
        print("usage: python -m paratrain.bench.collectives --worker CONFIG.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        return run(json.load(f))
