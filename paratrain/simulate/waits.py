"""Waiting for the slowest: what synchronizing workers whose compute jitters costs a step.

A collective every rank must join ends when the last one arrives. When each
rank's compute between two such synchronizations varies independently with
standard deviation sigma, the last of P arrives E_P sigma after the mean,
E_P the expected largest of P standard normal samples (Tippett 1925: 0.56 for
2, 1.03 for 4, 1.42 for 8). A step that synchronizes S times splits its
compute's variance over S segments (sigma_step^2 = S sigma_segment^2), so it
waits E_P sigma_step sqrt(S) in all: the more often a strategy synchronizes
inside a step, the more of the jitter it pays. Data parallelism synchronizes
once a step (its last bucket), tensor parallelism at each of its activation
all-reduces (Megatron's four a block, and the embedding's), ZeRO-3 at each
layer's reduce-scatter in backward (its gathers are prefetched a layer ahead,
so a rank late by less than a layer's compute holds nobody up there) and at
the step's end; an asynchronous parameter server never. A pipeline's stages
meet at every micro-batch they hand on, with slack between meetings that
depends on the schedule: pipeline.py runs the schedule with drawn action
times instead.

sigma_step is measured here (the step-to-step spread of the timed steps, simulate/here.py)
or declared (a WORKLOAD's ``step_jitter_ms``); 0 leaves the step as it was.
"""
import functools
import math

import numpy as np


@functools.lru_cache(maxsize=None)
def expected_largest(P):
    """E[max of P independent standard normal samples] (0 for one)."""
    if P <= 1:
        return 0.0
    x = np.linspace(-8.0, 8.0, 16001)
    density = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    below = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return float(np.trapezoid(x * P * density * below ** (P - 1), x))


def step_to_step_spread(values):
    """The standard deviation of ``values`` from one to the next (von Neumann et al. 1941:
    the mean squared successive difference is twice the variance): a shared host's
    slow drift over a run, which every rank feels alike and so makes none wait for
    another, is left out, where the plain standard deviation counts it (gpt's ZeRO-3
    steps: 9.8% of the median against 17.5%). The spread of a run's steps (compare)
    and of the steps timed for a prediction (timing.Timed) alike."""
    if len(values) < 2:
        return 0.0
    return math.sqrt(sum((b - a) ** 2 for a, b in zip(values, values[1:])) / (2 * (len(values) - 1)))


def synchronizations(strategy, workload):
    """How many times ``strategy`` makes its ranks wait for each other in one step."""
    layers = workload.layers or 1
    return {"ps-asp": 0, "ps-ssp": 0, "pipeline": 0, "pipeline-zb": 0,
            "tensor": 4 * layers + 1, "zero3": layers + 1, "powersgd": 2}.get(strategy, 1)


def seconds(P, sigma_step, syncs):
    """A step's waiting for the slowest of P ranks, its compute's spread ``sigma_step``."""
    return expected_largest(P) * sigma_step * math.sqrt(syncs) if syncs and sigma_step else 0.0
