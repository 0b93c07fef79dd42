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
