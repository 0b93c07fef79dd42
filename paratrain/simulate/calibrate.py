"""Fitting a link's alpha, beta and gamma to measured collective times.

Each measurement is (algorithm, P, n, seconds); the model says seconds =
steps alpha + sent beta + reduced gamma, with the counts from
collectives.py, so the fit is a least-squares problem in three unknowns. Two
things make it a careful one:

- Relative error, not absolute: a 4 KiB all-reduce takes microseconds and a
  64 MiB one hundreds of milliseconds; unweighted, the large messages alone
  would set every constant and alpha would be noise. Each row is divided by
  its measured time.
- Ranks beyond the cores share them. A collective is as slow as its
  slowest rank, and a collective's phases are shorter than the scheduler's
  balancing, so the ranks on the most crowded core set the pace: ceil(P/C)
  times the work (3 ranks on 2 cores run as 2 on one core, not 1.5); and the
  ranks' copies contend for one memory bus, a further (P/C)^(k-1):
  ``oversubscribed``. The fit tries k from 1 to 3 and keeps the best,
  dividing it out, so the constants are a core's own; predictions for P > C
  put it back. Only the ranks at work count (collectives.busy_ranks: the
  extra ranks of recursive doubling wait). (Compute, a step long, is
  balanced by the scheduler: P/C, ``time_shared``.)
- Ranks with a core each and ranks sharing cores are two links. With a core
  each, a rank spins on the flags its peers set and every copy stays in its
  own core's cache; past the cores, each hand-off waits for the scheduler to
  run the peer and the peers' buffers share a cache. One alpha and beta for
  both fit neither (ring's 2-rank calls too slow in a core's cache, too fast
  past it). So the samples are split at P = cores (``by_regime``): the
  link keeps its name for ranks on their own cores and ``<name>_crowded``
  is fitted on the rest, with its exponent k; predictions past the cores
  use the crowded link (``link_for_ranks``, system.Cluster.host_link).
- Constants are not negative. With one algorithm the bytes reduced are a
  fixed share of the bytes sent (ring: a half), so gamma cannot be told from
  beta and the plain solution may trade one against the other below zero.
  The fit tries every subset of the three constants and keeps the best
  non-negative solution (Lawson & Hanson's NNLS, by enumeration: three
  unknowns). Measuring two algorithms with different shares (ring and tree)
  separates gamma from beta.
- Memory has two rates. A buffer that fits a core's cache (here 1-2 MiB of
  L2) copies and reduces faster than one streamed from the shared L3 or
  DRAM, so one beta is too slow for 256 KiB and too fast for 16 MiB. The fit
  also tries a cache size from CACHES, charging the share of the bytes past
  it a fourth constant, ``beyond`` (collectives.Link), and keeps it when it
  fits better; with it, the same enumeration is over four unknowns. The
  share past it takes two shapes, and the fit keeps the better: a ramp (the
  bytes beyond the cache's size) or a cliff (every byte, once the buffer is
  past it: an in-order sweep through a least-recently-used cache misses on
  every line). Ranks with a core each fit the ramp; ranks sharing cores,
  evicting each other's lines, the cliff (all_reduce at 3 and 4 ranks on 2
  cores: 1 MiB at 0.8 ns a byte, 2 to 16 MiB at 1.0-1.1).
"""
import dataclasses
import itertools
import math
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from .collectives import Link, all_reduce, busy_ranks, hierarchical_all_reduce


CONTENTION = tuple(1 + i / 4 for i in range(9))   # the exponents k the fit tries
CACHES = (0, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20)   # cache sizes it tries (0: one rate)


def oversubscribed(P, cores, contention=1.0):
    """How many times longer a collective of P ranks takes when they share ``cores`` cores:
    ceil(P / cores) (P / cores)^(contention - 1); 1 when each has its own, or ``cores`` is None."""
    if not cores or P <= cores:
        return 1.0
    return math.ceil(P / cores) * (P / cores) ** (contention - 1)


def time_shared(P, cores):
    """How many times longer a step's compute takes when P processes share ``cores`` cores:
    P / cores (1 when each has its own, or ``cores`` is None); the scheduler moves them
    between cores over a step, so each gets its share."""
    return max(1.0, P / cores) if cores else 1.0


def terms_matrix(samples, cores=None, contention=1.0, cache_bytes=0, cliff=False):
    """(rows of [steps, sent, reduced, bytes past the cache], measured seconds) for samples
    (algorithm, P, n, seconds)."""
    probe = Link(0.0, 0.0, 0.0, cache_bytes, cliff=cliff)
    rows, times = [], []
    for algorithm, P, n, seconds in samples:
        t = all_reduce(algorithm, P, n)
        k = oversubscribed(busy_ranks(algorithm, P), cores, contention)
        rows.append([k * t.steps, k * t.sent, k * t.reduced, k * t.far_bytes(probe)])
        times.append(seconds)
    return np.array(rows, dtype=np.float64), np.array(times, dtype=np.float64)


CROWDED = "_crowded"   # the suffix of a link's name fitted on more ranks than cores


def by_regime(samples, cores):
    """{link name: samples} with each link's samples of more ranks than ``cores`` under
    ``<name>_crowded``; a link measured on one side of the cores only keeps its name."""
    out = {}
    for name, rows in samples.items():
        own = [s for s in rows if not cores or s[1] <= cores]
        crowded = [s for s in rows if cores and s[1] > cores]
        if own and crowded:
            out[name], out[name + CROWDED] = own, crowded
        else:
            out[name] = rows
    return out


def link_for_ranks(links, name, P, cores):
    """The name among fitted ``links`` that P ranks on a host of ``cores`` cores meet:
    ``name``'s crowded link past the cores where one was fitted, else ``name``."""
    if cores and P > cores and name + CROWDED in links:
        return name + CROWDED
    return name


def fit(samples, cores=None, caches=CACHES):
    """(the Link, the contention exponent) whose predictions are closest to ``samples``'
    times in relative terms, the ranks sharing ``cores`` cores (None: each has its own);
    ``caches``: the cache sizes tried (see above; (0,) fits one rate)."""
    if len(samples) < 2 or not all(s[-1] > 0 for s in samples):
        raise ValueError("calibration needs at least two measurements, each of a positive time")
    tried = [(_fit_constants(samples, cores, k, c, cliff), k) for k in (CONTENTION if cores else (1.0,))
             for c in caches for cliff in ((False, True) if c else (False,))]
    (link, _), k = min(tried, key=lambda r: r[0][1])
    return link, k


def _fit_constants(samples, cores, contention, cache_bytes=0, cliff=False):
    """(Link, squared relative error) of the best non-negative constants for one exponent,
    one cache size and one shape of the bytes past it."""
    A, t = terms_matrix(samples, cores, contention, cache_bytes, cliff)
    A, b = A / t[:, None], np.ones_like(t)   # relative error: (prediction - t) / t
    unknowns = 4 if cache_bytes else 3
    best, best_error = np.zeros(4), np.inf
    for k in range(1, unknowns + 1):
        for keep in itertools.combinations(range(unknowns), k):
            x, *_ = np.linalg.lstsq(A[:, keep], b, rcond=None)
            if (x < 0).any():
                continue
            full = np.zeros(4)
            full[list(keep)] = x
            error = float(np.sum((A @ full - b) ** 2))
            if error < best_error - 1e-12:
                best, best_error = full, error
    alpha, beta, gamma, beyond = map(float, best)
    return Link(alpha, beta, gamma, cache_bytes if beyond else 0.0, beyond, bool(beyond) and cliff), best_error


def relative_errors(link, samples, cores=None, contention=1.0):
    """(prediction - measured) / measured, per sample."""
    A, t = terms_matrix(samples, cores, contention, link.cache_bytes, link.cliff)
    floors = np.array([link.floor * oversubscribed(busy_ranks(a, P), cores, contention) for a, P, _, _ in samples])
    return (np.maximum(A @ np.array([link.alpha, link.beta, link.gamma, link.beyond]), floors) - t) / t


def fit_network(samples):
    """The Link of a network between pretend hosts (one rate, no cache): alpha, beta and
    gamma as ``fit`` finds them, or, where it fits better, those of the larger sizes over
    a ``floor`` the smaller ones take (a rate-limited link's burst: collectives.Link). Each
    split of the sizes is tried: the floor closest in relative terms to the times below
    it, the constants fitted to those above, the error taken over all."""
    best, _ = fit(samples, caches=(0,))
    best_error = float(np.sum(relative_errors(best, samples) ** 2))
    ordered = sorted(samples, key=lambda s: s[2])
    for k in range(1, len(ordered)):
        below, above = ordered[:k], ordered[k:]
        if len({s[2] for s in above}) < 2:
            break
        inverse = np.array([1.0 / s[-1] for s in below])
        line, _ = fit(above, caches=(0,))
        link = dataclasses.replace(line, floor=float(inverse.sum() / (inverse ** 2).sum()))
        error = float(np.sum(relative_errors(link, samples) ** 2))
        if error < best_error - 1e-12:
            best, best_error = link, error
    return best


# ---- this machine: `paratrain bench collectives`, fitted ----------------------------------

ENGINES = {"paratrain": "direct", "paratrain/direct": "direct", "paratrain/ring": "ring", "paratrain/tree": "tree",
           "paratrain/naive": "naive"}
PATHS = {"direct": "shm_direct", "ring": "shm", "tree": "shm", "naive": "shm"}   # which link each one runs over
SIZES = "64K,256K,512K,1M,2M,4M,8M,16M"


def samples_from_bench(report):
    """{link name: [(algorithm, P, n, seconds)]} from a ``paratrain bench collectives`` JSON
    report's all_reduce rows on one host: the shared-memory engine's direct algorithm runs
    over memory copies and barriers ("shm_direct"), the message-passing ones over its
    channels ("shm"); Gloo's ring over TCP ("net": over a pretend link, the link), and the
    hierarchical backend's run ("hierarchical": shm inside each pretend host, Gloo between
    them)."""
    P = report["config"]["nproc"]
    out = {}
    for r in report["results"]:
        if r["collective"] != "all_reduce":
            continue
        seconds = r["median_us"] * 1e-6
        if r.get("run") == "hierarchical":
            out.setdefault("hierarchical", []).append(("hierarchical", P, r["bytes"], seconds))
            continue
        if r.get("run", "main") != "main":
            continue
        if r["engine"] == "gloo":
            out.setdefault("net", []).append(("ring", P, r["bytes"], seconds))
        elif r["engine"] in ENGINES:
            algorithm = ENGINES[r["engine"]]
            out.setdefault(PATHS[algorithm], []).append((algorithm, P, r["bytes"], seconds))
    return out


def _bench(runs, runner=None, wrap=lambda cmd: cmd):
    """{link name: samples} of ``paratrain bench collectives`` (all_reduce) run once per
    (ranks, extra options) in ``runs``, each command passed through ``wrap``."""
    samples = {}
    with tempfile.TemporaryDirectory() as folder:
        for i, (P, options) in enumerate(runs):
            out = os.path.join(folder, str(i))
            cmd = wrap([sys.executable, "-m", "paratrain", "bench", "collectives", "-n", str(P), "--collectives",
                        "all_reduce", "--no-mpi", *options, "--out", out])
            res = (runner or subprocess.run)(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"the collectives benchmark at {P} ranks failed:\n{res.stdout[-2000:]}"
                                   f"{res.stderr[-2000:]}")
            with open(os.path.join(out, "collectives.json")) as f:
                for name, rows in samples_from_bench(json.load(f)).items():
                    samples.setdefault(name, []).extend(rows)
    return samples


def measure_here(ranks=(2, 3, 4), sizes=SIZES, runner=None):
    """Run ``paratrain bench collectives`` (all_reduce; direct, ring and tree) at each rank
    count, every size timed in each round (``--interleave-sizes``, as measure_link does): one
    size's rounds after another's let a slow stretch of this host fall on one size, and a
    2-rank 1 MiB call once read 0.44 ms in a run whose 4 MiB read 0.55 (fitted: 0.18 and
    0.69), which no alpha and beta follow. Returns {link name: samples}."""
    return _bench([(P, ["--sizes", sizes, "--algorithms", "ring,tree", "--no-gloo", "--interleave-sizes"])
                   for P in ranks], runner)


# ---- two pretend hosts joined by a slow link ----------------------------------------------

LINK_RATES = ("1gbit", "10gbit")
LINK_SIZES = "256K,1M,2M,4M,8M,16M"
LINK_ITERS = "20"   # rounds per size: 16 MiB over 1 Gbit/s takes a quarter of a second a call


def measure_link(rate, sizes=LINK_SIZES, runner=None):
    """Two pretend hosts on this machine joined by a link of ``rate`` (launch/link.py: a
    network namespace whose loopback a token bucket limits): Gloo's all-reduce between
    one rank on each ("net"), and the hierarchical backend with two ranks on each
    ("hierarchical": shm inside a host, Gloo between the hosts' leaders). Returns
    {"net": samples, "hierarchical": samples}.

    Each round times every size in turn (``--interleave-sizes``). One size's rounds
    after another's let a slow stretch of this shared host fall on one size: a 2 MiB
    median then read 5.4 ms in one run and 3.8 in the next, slower than 4 MiB's, and no
    alpha and beta fitted the 10 Gbit/s link within 15%. Interleaved, two runs of the
    link agreed within 5% at four sizes of six (12-14% at the others), close to a line."""
    from ..launch import link
    why = link.check(rate)
    if why:
        raise RuntimeError(why)
    options = ["--sizes", sizes, "--iters", LINK_ITERS, "--interleave-sizes"]
    return _bench([(2, options), (4, [*options, "--no-gloo", "--hierarchical"])], runner,
                  wrap=lambda cmd: link.limited(rate, cmd))


def hierarchical_seconds(P, n, intra, inter, cores=None, contention=1.0, hosts=2):
    """comm/hierarchical.py's all-reduce of P ranks on ``hosts`` pretend hosts of this
    machine: every rank works in the shared-memory phases, so they share the cores
    (``oversubscribed``, with shm's fitted contention); the leaders' Gloo crosses the link."""
    slow = oversubscribed(P, cores, contention)
    return hierarchical_all_reduce(hosts, P // hosts, n, intra.slowed(slow), inter)


def link_errors(samples, net, intra, cores=None, contention=1.0):
    """{"net": relative errors of ``net``'s fit to its own samples, "hierarchical": of the
    hierarchical runs, predicted from ``net`` and the host's ``intra`` link (not fitted on
    them: held out)}."""
    out = {"net": [float(e) for e in relative_errors(net, samples["net"])]}
    out["hierarchical"] = [hierarchical_seconds(P, n, intra, net, cores, contention) / s - 1
                           for _, P, n, s in samples.get("hierarchical", [])]
    return out


def fit_links(samples, cores=None):
    """{link name: (Link, contention exponent)} fitted to each link's samples, split by_regime."""
    return {name: fit(rows, cores) for name, rows in by_regime(samples, cores).items()}


def held_out_errors(samples, cores=None, min_bytes=1 << 20):
    """|relative errors| at each size of at least ``min_bytes`` under a fit to the other
    sizes: how well the model's form (alpha, beta, gamma and the cache's step) carries to a
    size it was not fitted on, where a fit of as many constants as sizes would match any
    samples. None with fewer than four sizes (four constants)."""
    size = {s: round(s[2] / 1024) for s in samples}   # 3 ranks time 4 bytes fewer: a multiple of 3 floats
    sizes = sorted(set(size.values()))
    if len(sizes) < 4:
        return None
    out = []
    for held in sizes:
        test = [s for s in samples if size[s] == held]
        if held * 1024 < min_bytes or not test:
            continue
        link, k = fit([s for s in samples if size[s] != held], cores)
        out += [abs(float(e)) for e in relative_errors(link, test, cores, k)]
    return out or None
