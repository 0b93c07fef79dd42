"""Slow workers on purpose: ``--straggler RANK:FACTOR`` and ``--jitter P:FACTOR``.

Synchronous training runs at the speed of its slowest worker; asynchronous
and bounded-staleness training trade some of that wait for staler gradients
(Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel
Parameter Server", NIPS 2013, sec. 1 and 5). To see the trade-off on one
machine we make workers slow in two ways:

- a straggler: one rank is slower on every step, a persistently slow machine;
- jitter: every rank is slower on a step with probability P, a transient
  hiccup (a garbage collection, a noisy neighbour).

A slowdown by FACTOR sleeps (FACTOR - 1) times the step's *measured* compute
time (forward and backward on that worker, communication excluded), so
``--straggler 1:3`` means "rank 1 computes 3x slower" on any machine and for
any model, instead of an absolute delay that would mean a different thing on
each. When both apply to one step the factors multiply (a slow machine that
also hiccups).

Jitter's coin flips come from a generator of this rank's own, seeded from
(--seed, rank) and drawn once per step whether or not it slows, so the
decisions of a run are reproducible and do not depend on how long steps take.
The generator is Python's ``random.Random`` seeded with a string, which is
stable across processes and Python versions (it hashes the string with
SHA-512; PYTHONHASHSEED plays no part).
"""
import argparse
import random
import time


def _parse_pair(text, flag, first_name, first_type):
    try:
        a, b = text.split(":")
        first, factor = first_type(a), float(b)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{flag} expects {first_name}:FACTOR, e.g. {'1:3' if first_type is int else '0.3:3'}; "
            f"got {text!r}") from None
    if not factor >= 1 or factor == float("inf"):
        raise argparse.ArgumentTypeError(f"{flag}: FACTOR must be a finite number >= 1 (how many times slower), "
                                         f"got {b}")
    return first, factor


def straggler_spec(text):
    """'RANK:FACTOR' -> (rank, factor); argparse type of --straggler."""
    rank, factor = _parse_pair(text, "--straggler", "RANK", int)
    if rank < 0:
        raise argparse.ArgumentTypeError(f"--straggler: RANK must be >= 0, got {rank}")
    return rank, factor


def jitter_spec(text):
    """'P:FACTOR' -> (probability, factor); argparse type of --jitter."""
    p, factor = _parse_pair(text, "--jitter", "P", float)
    if not 0 <= p <= 1:
        raise argparse.ArgumentTypeError(f"--jitter: P is a probability between 0 and 1, got {p:g}")
    return p, factor


class Slowdown:
    """One worker's slowdowns. Call ``after_compute(seconds)`` once per step with
    that step's measured compute time; it sleeps as the options say and returns
    the seconds slept. ``compute_s``, ``slept_s`` and ``slowed_steps`` add up
    what happened, for the run's summary."""

    def __init__(self, rank, seed=0, straggler=None, jitter=None, sleep=time.sleep):
        self.rank = rank
        self.straggler_factor = straggler[1] if straggler and straggler[0] == rank else 1.0
        self.jitter_p, self.jitter_factor = jitter if jitter else (0.0, 1.0)
        self.rng = random.Random(f"paratrain-jitter/{seed}/{rank}")
        self._sleep = sleep
        self.steps = self.slowed_steps = 0
        self.compute_s = self.slept_s = 0.0

    @classmethod
    def from_args(cls, args, rank):
        return cls(rank, args.seed, args.straggler, args.jitter)

    @property
    def active(self):
        return self.straggler_factor > 1 or (self.jitter_p > 0 and self.jitter_factor > 1)

    def factor(self):
        """This step's factor: the straggler's times, when the coin says so, jitter's.
        Draws one number per step, even when jitter is off (the sequence of a rank
        then depends only on the seed and the step)."""
        hiccup = self.rng.random() < self.jitter_p
        return self.straggler_factor * (self.jitter_factor if hiccup else 1.0)

    def after_compute(self, compute_seconds):
        f = self.factor()
        self.steps += 1
        self.compute_s += compute_seconds
        if f <= 1:
            return 0.0
        delay = (f - 1) * compute_seconds
        self.slowed_steps += 1
        t0 = time.perf_counter()
        self._sleep(delay)
        slept = time.perf_counter() - t0  # measured: what the summary reports is what happened
        self.slept_s += slept
        return slept
