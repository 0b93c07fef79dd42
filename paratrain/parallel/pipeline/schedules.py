"""Pipeline schedules: in what order each rank runs its micro-batches' work.

A schedule is, for each rank, a list of actions ``(kind, microbatch, chunk)``:

- ``F``: forward of one micro-batch through one of the rank's stages (its
  input received from the previous stage, its output sent to the next);
- ``B``: backward of it (the output's gradient received from the next stage,
  the input's gradient sent back). In the schedules without a ``W``, ``B`` is
  the whole backward, weight gradients included;
- ``W``: the weight gradients of a micro-batch whose ``B`` computed only the
  input gradients (zero-bubble schedules).

``chunk`` is which of the rank's stages (0 unless the schedule interleaves
virtual stages: rank r's chunk c is stage c * p + r of the p * v).

Sends never block (isend, waited at the end of the step) and a receive blocks,
so a rank runs its list in order and waits only for data. ``simulate`` runs
the lists against each other with given costs, which tells whether a schedule
can deadlock and what its bubble is (tests check both for every schedule).

With p stages and m micro-batches, F and B (full) taking f and b:

- ``gpipe`` (Huang et al., arXiv 1811.06965): every forward, then every
  backward. Step (m + p - 1)(f + b), bubble (p - 1)/(m + p - 1); every
  micro-batch's activations are held at once.
- ``1f1b`` (PipeDream-Flush; Narayanan et al., arXiv 2104.04473, sec. 2.2):
  p - r - 1 forwards to fill the pipe, then one forward one backward, then the
  remaining backwards. Same bubble, but rank r holds at most p - r
  micro-batches of activations instead of m.
- ``interleaved`` (the same paper, sec. 2.2.2): each rank holds v stages (v
  "virtual stages", cut from the model round robin), so the fill and drain
  go v times faster: bubble (p - 1)/(v m + p - 1), for v times more
  messages. Megatron-LM's order: micro-batches in groups of p, each group
  through chunk 0, then chunk 1, ...; m must be a multiple of p.
- ``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv
  2401.10241, sec. 3, "ZB-H1"): 1F1B's order with the backward split into B
  (input gradient: what the previous stage waits for) and W (weight
  gradient: what nobody waits for), and each W run where the rank would
  otherwise wait for data, so with f = b = w the idle time is a third of
  1F1B's (``_zero_bubble_h1`` says what that costs in memory).
"""
import functools

import numpy as np


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
SPLIT_BACKWARD = {"zb-h1"}      # schedules whose B computes input gradients only, W the weights'


def actions(schedule, rank, stages, microbatches, chunks=1):
    """The ordered list of (kind, microbatch, chunk) that ``rank`` runs in one step."""
    p, m, r = stages, microbatches, rank
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        return _one_forward_one_backward(p, m, r)
    if schedule == "zb-h1":
        return _zero_bubble_h1(p, m, r)
    if schedule == "interleaved":
        return _interleaved(p, m, r, chunks)
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def _one_forward_one_backward(p, m, r):
    warmup = min(p - r - 1, m)
    out = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        out += [("F", warmup + i, 0), ("B", i, 0)]
    return out + [("B", i, 0) for i in range(m - warmup, m)]


def _zero_bubble_h1(p, m, r):
    """1F1B's F and B, with each W put where its rank would otherwise wait.

    The W's are placed by running the ranks' F/B lists against each other with
    f = b = w (one time unit each): a rank whose next F or B has no input yet
    runs its oldest pending W instead; a rank that would start an F while
    holding 2p micro-batches between F and W runs a W first, so activations
    kept for W stay bounded; what is left runs at the end. With m >= p this
    reaches the paper's ZB-H1 step, 3m + p - 1 units against 1F1B's 3(m + p -
    1): the bubble is a third of 1F1B's. The price: every rank holds up to 2p
    micro-batches between F and W (1F1B holds p - r between F and B), though
    after B only the weight operations' inputs are still needed.

    Why the bound is on what a rank holds, the same 2p on every rank: a bound of
    p pending W's would make the last stage run a W before its last F, while the
    first stage waits for that micro-batch's B.

    The list is where each W goes at the latest: past its last F, the first
    stage runs its pending W's early while a B's gradient is on its way
    (engine.py, ``Pipeline._weights_while_waiting``), since F, B and W are not
    equal in practice and nobody waits for the first stage's B."""
    return _place_weight_gradients(p, m)[r]


def _place_weight_gradients(p, m):
    base = [_one_forward_one_backward(p, m, q) for q in range(p)]
    lists = [[] for _ in range(p)]
    pos, clock, pending, held = [0] * p, [0] * p, [[] for _ in range(p)], [0] * p
    done = {}                      # (kind, mb, rank) -> finish time
    active = set(range(p))
    while active:
        for q in sorted(active, key=lambda q: clock[q]):   # the rank that is free first decides first
            if pos[q] == len(base[q]):
                if pending[q]:
                    lists[q].append(("W", pending[q].pop(0), 0))
                    clock[q] += 1
                    held[q] -= 1
                else:
                    active.discard(q)
                break
            kind, mb, _ = base[q][pos[q]]
            need = [("F", mb, q - 1)] if kind == "F" and q > 0 else []
            if kind == "B":
                need = [("F", mb, q)] + ([("B", mb, q + 1)] if q < p - 1 else [])
            ready = all(n in done for n in need)
            waits = not ready or max([0] + [done[n] for n in need]) >= clock[q] + 1
            if pending[q] and ((kind == "F" and held[q] >= 2 * p) or waits):
                lists[q].append(("W", pending[q].pop(0), 0))
                clock[q] += 1
                held[q] -= 1
                break
            if ready:
                clock[q] = max([clock[q]] + [done[n] for n in need]) + 1
                done[(kind, mb, q)] = clock[q]
                lists[q].append((kind, mb, 0))
                pos[q] += 1
                held[q] += kind == "F"
                if kind == "B":
                    pending[q].append(mb)
                break
        else:
            raise AssertionError("W placement found no rank able to move")   # cannot happen: 1F1B is deadlock-free
    return lists


def _interleaved(p, m, r, v):
    if m % p:
        raise ValueError(f"the interleaved schedule needs microbatches ({m}) to be a multiple of the "
                         f"number of pipeline ranks ({p}): micro-batches go through each chunk in groups of {p}")

    def order(k, backward):
        group, within = divmod(k, p * v)
        chunk = within // p
        return group * p + within % p, (v - 1 - chunk) if backward else chunk

    total = m * v
    warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    out = [("F", *order(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        out += [("F", *order(warmup + k, False)), ("B", *order(k, True))]
    return out + [("B", *order(k, True)) for k in range(total - warmup, total)]


def stage_of(rank, chunk, stages):
    """Which of the p * v stages rank's chunk is (round robin over ranks)."""
    return chunk * stages + rank


def simulate(schedule, stages, microbatches, chunks=1, cost=None, duration=None):
    """Run every rank's list against the others with each action's cost in time
    units (default F 1, B 2, or B 1 and W 1 when split; or a list of such costs, one
    per rank, where the stages differ); no communication cost. ``duration(rank, kind,
    cost)``, when given, is what each action takes instead of its cost: a numpy array of
    draws around it, the same length each time (simulate/pipeline.py's jittered
    stages); the makespan is then an array too, one a draw.

    Returns (makespan, per-rank busy time, per-rank list of (kind, mb, chunk,
    start, end)). Raises RuntimeError on a deadlock (some rank waits for data
    that no remaining action can produce)."""
    p, v = stages, chunks
    split = schedule in SPLIT_BACKWARD
    cost = cost or ({"F": 1.0, "B": 1.0, "W": 1.0} if split else {"F": 1.0, "B": 2.0})
    costs = cost if isinstance(cost, (list, tuple)) else [cost] * p
    lists = [actions(schedule, r, p, microbatches, v) for r in range(p)]
    last = p * v - 1
    done = {}          # (kind, mb, stage) -> finish time
    pos, clock = [0] * p, [0.0] * p
    trace = [[] for _ in range(p)]
    remaining = sum(len(a) for a in lists)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                kind, mb, c = lists[r][pos[r]]
                s = stage_of(r, c, p)
                if kind == "F":
                    need = [("F", mb, s - 1)] if s > 0 else []
                elif kind == "B":
                    need = [("F", mb, s)] + ([("B", mb, s + 1)] if s < last else [])
                else:
                    need = [("B", mb, s)]
                if any(n not in done for n in need):
                    break
                if duration:
                    start = functools.reduce(np.maximum, [done[n] for n in need], clock[r])
                    end = start + duration(r, kind, costs[r][kind])
                else:
                    start = max([clock[r]] + [done[n] for n in need])
                    end = start + costs[r][kind]
                done[(kind, mb, s)] = end
                trace[r].append((kind, mb, c, start, end))
                clock[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: lists[r][pos[r]] for r in range(p) if pos[r] < len(lists[r])}
            raise RuntimeError(f"schedule {schedule!r} deadlocks (p={p}, m={microbatches}, v={v}): "
                               f"ranks wait on {stuck}")
    makespan = functools.reduce(np.maximum, clock) if duration else max(clock)
    busy = [sum(e - s for _, _, _, s, e in t) for t in trace]
    return makespan, busy, trace


def bubble_formula(schedule, stages, microbatches, chunks=1):
    """The idle fraction of a step the papers give, for f = b (= w): (p-1)/(m+p-1)
    for GPipe and 1F1B, (p-1)/(v m + p-1) interleaved, and for ZB-H1 a third of
    1F1B's idle time: (p-1)/(3m+p-1)."""
    p, m, v = stages, microbatches, chunks
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)
