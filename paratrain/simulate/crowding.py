"""What a synchronization costs when a host's ranks outnumber its cores.

Compute shared by P ranks on C < P cores takes P/C times as long
(calibrate.time_shared): the scheduler balances a step's worth of work.
A synchronization of all P ranks breaks that balance each time. The ranks
that arrive first block, and the ones still computing may be queued on one
core while the other core idles, until the kernel balances its run queues
again. Measured here with plain processes (no paratrain in the way), four
on two cores meeting at a barrier after each w of work:

    w = 1.0 ms: +1.63 ms a synchronization; 3.0 ms: +2.27; 7.9 ms: +3.18
    (matrix products; --calibrate's elementwise work, minutes later: +1.24,
    +1.53, +1.54)

Two processes handing a token back and forth, four on the same two cores,
pay under 0.2 ms a hand-off. So the cost is charged to a synchronization of
more ranks than cores (a data-parallel all-reduce, a tensor group's
all-reduces, ZeRO-3's reduce-scatters: waits.synchronizations), as base + per_work x
w, with w the compute a rank does between two of them on a core of its own.
``paratrain simulate --calibrate`` fits base and per_work here (``measure``).
"""
import dataclasses
import time

import numpy as np

from . import forked
from .calibrate import time_shared

WORKS_S = (0.001, 0.003, 0.008)   # a rank's work between two synchronizations, in the measurement


@dataclasses.dataclass(frozen=True)
class Crowding:
    base_s: float       # seconds a synchronization of more ranks than cores costs...
    per_work: float     # ...plus this share of the work a rank does between two

    def seconds(self, syncs, step_compute_s, group, ranks_here, cores):
        """What ``syncs`` synchronizations of ``group`` ranks add to a step whose compute is
        ``step_compute_s`` with ``ranks_here`` ranks sharing ``cores`` cores (time_shared);
        0 when the group has a core a rank."""
        if not syncs or not cores or group <= cores:
            return 0.0
        work = step_compute_s / time_shared(ranks_here, cores) / syncs
        return syncs * (self.base_s + self.per_work * work)


def fit(points):
    """Crowding of (work seconds, extra seconds a synchronization) points: least squares,
    neither term below 0."""
    w, extra = np.array(points, dtype=float).T
    per_work, base = np.linalg.lstsq(np.stack([w, np.ones_like(w)], axis=1), extra, rcond=None)[0]
    if base < 0:
        per_work, base = float(np.dot(w, extra) / np.dot(w, w)), 0.0
    if per_work < 0:
        per_work, base = 0.0, float(extra.mean())
    return Crowding(max(0.0, float(base)), max(0.0, float(per_work)))


def _work(x, n):
    """n passes of elementwise arithmetic over x: single-threaded whatever the BLAS."""
    for _ in range(n):
        np.sqrt(x * x + 1.0, out=x)


def _passes_for(seconds):
    x = np.random.default_rng(0).random(1 << 14)
    _work(x, 20)
    t0 = time.perf_counter()
    _work(x, 200)
    return max(1, round(seconds / ((time.perf_counter() - t0) / 200)))


def _rank(barrier, passes, iterations, synchronize, out):
    x = np.random.default_rng(1).random(1 << 14)
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(iterations):
        _work(x, passes)
        if synchronize:
            barrier.wait()
    out.put(time.perf_counter() - t0)


def _iteration_seconds(ranks, passes, iterations, synchronize):
    import multiprocessing
    fork = multiprocessing.get_context("fork")
    barrier, out = fork.Barrier(ranks), fork.Queue()
    procs = [fork.Process(target=_rank, args=(barrier, passes, iterations, synchronize, out), daemon=True)
             for _ in range(ranks)]
    for p in procs:
        p.start()
    try:
        return max(out.get(timeout=120) for _ in procs) / iterations
    finally:
        forked.end(procs, 10)


def measure(cores, works_s=WORKS_S, seconds=1.5):
    """Crowding of this host: 2 x ``cores`` processes, each doing w of work then meeting
    at a barrier, against the same without the barrier, for each w; and the points."""
    ranks, points = 2 * cores, []
    for w in works_s:
        passes = _passes_for(w)
        iterations = max(20, round(seconds / (w * ranks / cores)))
        synced = _iteration_seconds(ranks, passes, iterations, True)
        free = _iteration_seconds(ranks, passes, iterations, False)
        points.append((w, synced - free))
    return fit(points), points
