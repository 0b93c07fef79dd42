"""Fitting a link's alpha, beta and gamma to measured collective times.

Each measurement is (algorithm, P, n, seconds); the model says seconds =
steps alpha + sent beta + reduced gamma, with the counts from
collectives.py, so the fit is a least-squares problem in three unknowns. Two
things make it a careful one:

- Relative error, not absolute: a 4 KiB all-reduce takes microseconds and a
  64 MiB one hundreds of milliseconds; unweighted, the large messages alone
  would set every constant and alpha would be noise. Each row is divided by
  its measured time.
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


def terms_matrix(samples):
    """(rows of [steps, sent, reduced], measured seconds) for samples (algorithm, P, n, seconds)."""
    rows, times = [], []
    for algorithm, P, n, seconds in samples:
        t = all_reduce(algorithm, P, n)
        rows.append([t.steps, t.sent, t.reduced])
        times.append(seconds)
    return np.array(rows, dtype=np.float64), np.array(times, dtype=np.float64)


def fit(samples):
    """The Link whose predictions are closest to ``samples``' times in relative terms."""
    A, t = terms_matrix(samples)
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
    return Link(*map(float, best))


def relative_errors(link, samples):
    """(prediction - measured) / measured, per sample."""
    A, t = terms_matrix(samples)
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


def fit_links(samples):
    """{link name: Link} fitted to each link's samples."""
    return {name: fit(rows) for name, rows in samples.items()}
