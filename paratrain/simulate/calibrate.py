"""Fitting a link's alpha, beta and gamma to measured collective times.

Each measurement is (algorithm, P, n, seconds); the model says seconds =
steps alpha + sent beta + reduced gamma, with the counts from
collectives.py, so the fit is a least-squares problem in three unknowns. Two
things make it a careful one:

- Relative error, not absolute: a 4 KiB all-reduce takes microseconds and a
  64 MiB one hundreds of milliseconds; unweighted, the large messages alone
  would set every constant and alpha would be noise. Each row is divided by
  its measured time.
- Ranks beyond the cores share them: at P ranks on C cores each rank runs
  C/P of the time, so every term of a collective over shared memory takes
  at least P/C times as long, and more (a rank that waits spins on a core
  another needs; the ranks' copies contend for one memory bus):
  (P/C)^k, ``oversubscribed``. The fit tries k from 1 to 3 and keeps the
  best, dividing it out, so the constants are a core's own; predictions for
  P > C put it back.
- Constants are not negative. With one algorithm the bytes reduced are a
  fixed share of the bytes sent (ring: a half), so gamma cannot be told from
  beta and the plain solution may trade one against the other below zero.
  The fit tries every subset of the three constants and keeps the best
  non-negative solution (Lawson & Hanson's NNLS, by enumeration: three
  unknowns). Measuring two algorithms with different shares (ring and tree)
  separates gamma from beta.
"""
import itertools
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from .collectives import Link, all_reduce


CONTENTION = tuple(1 + i / 4 for i in range(9))   # the exponents k the fit tries


def oversubscribed(P, cores, contention=1.0):
    """How many times longer a collective of P ranks takes when they share ``cores`` cores:
    (P / cores)^contention (1 when each has its own, or ``cores`` is None)."""
    return max(1.0, P / cores) ** contention if cores else 1.0


def terms_matrix(samples, cores=None, contention=1.0):
    """(rows of [steps, sent, reduced], measured seconds) for samples (algorithm, P, n, seconds)."""
    rows, times = [], []
    for algorithm, P, n, seconds in samples:
        t = all_reduce(algorithm, P, n)
        k = oversubscribed(P, cores, contention)
        rows.append([k * t.steps, k * t.sent, k * t.reduced])
        times.append(seconds)
    return np.array(rows, dtype=np.float64), np.array(times, dtype=np.float64)


def fit(samples, cores=None):
    """(the Link, the contention exponent) whose predictions are closest to ``samples``'
    times in relative terms, the ranks sharing ``cores`` cores (None: each has its own)."""
    if len(samples) < 2 or not all(s[-1] > 0 for s in samples):
        raise ValueError("calibration needs at least two measurements, each of a positive time")
    tried = [(_fit_constants(samples, cores, k), k) for k in (CONTENTION if cores else (1.0,))]
    (link, _), k = min(tried, key=lambda r: r[0][1])
    return link, k


def _fit_constants(samples, cores, contention):
    """(Link, squared relative error) of the best non-negative constants for one exponent."""
    A, t = terms_matrix(samples, cores, contention)
    if len(t) < 2 or not (t > 0).all():
        raise ValueError("calibration needs at least two measurements, each of a positive time")
    A, b = A / t[:, None], np.ones_like(t)   # relative error: (prediction - t) / t
    best, best_error = np.zeros(3), np.inf
    for k in range(1, 4):
        for keep in itertools.combinations(range(3), k):
            x, *_ = np.linalg.lstsq(A[:, keep], b, rcond=None)
            if (x < 0).any():
                continue
            full = np.zeros(3)
            full[list(keep)] = x
            error = float(np.sum((A @ full - b) ** 2))
            if error < best_error:
                best, best_error = full, error
    return Link(*map(float, best)), best_error


def relative_errors(link, samples, cores=None, contention=1.0):
    """(prediction - measured) / measured, per sample."""
    A, t = terms_matrix(samples, cores, contention)
    return (A @ np.array([link.alpha, link.beta, link.gamma]) - t) / t


# ---- this machine: `paratrain bench collectives`, fitted ----------------------------------

ENGINES = {"paratrain": "direct", "paratrain/direct": "direct", "paratrain/ring": "ring", "paratrain/tree": "tree",
           "paratrain/naive": "naive"}
PATHS = {"direct": "shm_direct", "ring": "shm", "tree": "shm", "naive": "shm"}   # which link each one runs over
SIZES = "64K,256K,1M,4M,16M"


def samples_from_bench(report):
    """{link name: [(algorithm, P, n, seconds)]} from a ``paratrain bench collectives`` JSON
    report's all_reduce rows on one host: the shared-memory engine's direct algorithm runs
    over memory copies and barriers ("shm_direct"), the message-passing ones over its
    channels ("shm")."""
    P = report["config"]["nproc"]
    out = {}
    for r in report["results"]:
        algorithm = ENGINES.get(r["engine"])
        if r["collective"] != "all_reduce" or algorithm is None or r.get("run", "main") != "main":
            continue
        out.setdefault(PATHS[algorithm], []).append((algorithm, P, r["bytes"], r["median_us"] * 1e-6))
    return out


def measure_here(ranks=(2, 3, 4), sizes=SIZES, runner=None):
    """Run ``paratrain bench collectives`` (all_reduce; direct, ring and tree) at each rank
    count; returns {link name: samples}."""
    samples = {}
    with tempfile.TemporaryDirectory() as folder:
        for P in ranks:
            out = os.path.join(folder, str(P))
            cmd = [sys.executable, "-m", "paratrain", "bench", "collectives", "-n", str(P), "--collectives",
                   "all_reduce", "--sizes", sizes, "--algorithms", "ring,tree", "--no-mpi", "--no-gloo",
                   "--out", out]
            res = (runner or subprocess.run)(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"the collectives benchmark at {P} ranks failed:\n{res.stdout[-2000:]}"
                                   f"{res.stderr[-2000:]}")
            with open(os.path.join(out, "collectives.json")) as f:
                for name, rows in samples_from_bench(json.load(f)).items():
                    samples.setdefault(name, []).extend(rows)
    return samples


def fit_links(samples, cores=None):
    """{link name: (Link, contention exponent)} fitted to each link's samples."""
    return {name: fit(rows, cores) for name, rows in samples.items()}


def held_out_errors(samples, cores=None, held=3, min_bytes=1 << 20):
    """|relative errors| of the ``held``-rank samples of at least ``min_bytes`` under a fit to
    the other rank counts: how well the model carries to a rank count it was not fitted on.
    None when there is nothing to hold out."""
    rest = [s for s in samples if s[1] != held]
    test = [s for s in samples if s[1] == held and s[2] >= min_bytes]
    if len(rest) < 2 or not test:
        return None
    link, k = fit(rest, cores)
    return [abs(float(e)) for e in relative_errors(link, test, cores, k)]
