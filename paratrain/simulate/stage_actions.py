"""A pipeline's stages timed as the engine runs them, each rank's neighbours stood in for.

A stage's F, B and W cost what they cost inside the engine's step, in its
schedule's order: which micro-batches' activations are still held, whether
the backward is split (every stage under ZB-H1, all but the first under
1F1B), the hooks that keep each weight owner's output for W, the header of
each bundle sent. Timing a stage's layers alone (as the cut does), with the
split measured on the whole model, misses these, and one stage's timing given
to every rank misses that the stages differ (the last holds the head and loss).

So each rank's stage is built as ``paratrain train --strategy pipeline``
builds it (the cut chosen by time on a micro-batch, each layer cut across a
tensor group first with ``tp`` > 1) and run by the engine itself
(``pt.Pipeline``) over ``StandInNeighbours``: a group whose sends go nowhere
and whose receives hand over, at once, the activations the stage before
would send (computed once, beforehand) and gradients of their shapes. What
the engine records of each action (its timeline) is then its compute alone.
Each rank runs in a process of its own, forked with what it was built from,
as many ranks at once as compute at once here in a run (the others beside
the timing pause meanwhile), each step begun together, each followed by its
optimizer step (untimed), as in a run; more ranks than that take turns a
step at a time, so that the host's pace falls on all of them alike. Taking
turns in one process instead, the ranks left each other's caches cold,
unlike a run's ranks, each computing on its own core: under ZB-H1 gpt's
last stage read 11-15% dearer than its first that way, 2-4% in a run, and
4% (a median) in processes of their own computing at once. What the
stand-ins leave out is the messages themselves (pipeline.py adds a send
timed between two real stages).
"""
import collections
import copy
import dataclasses
import statistics
import time

from . import forked, timing
from .compute_only import ComputeOnlyGroup, Done, cut_copy


class StandInNeighbours(ComputeOnlyGroup):
    """Rank ``rank`` of a ``world_size``-rank pipeline whose neighbours are stand-ins:
    receives of ``feeds`` tags (transport.tag's) hand over its values in turn, over and
    over; a gradient's receive, small values of its shape; anything else, zeros. Sends
    and the collectives before and after a step (every rank agreeing, the loss
    broadcast) move nothing."""

    def __init__(self, rank, world_size, feeds=None):
        super().__init__(world_size)
        self.rank = rank
        self._feeds = {tag: list(values) for tag, values in (feeds or {}).items()}
        self._queued = collections.defaultdict(collections.deque)
        self._gradients = {}

    def isend(self, tensor, dst, tag):
        return Done()

    def recv(self, tensor, src, tag):
        import torch
        from ..parallel.pipeline import transport
        if tag in self._feeds:
            if not self._queued[tag]:
                self._queued[tag].extend(self._feeds[tag])
            tensor.copy_(self._queued[tag].popleft())
        elif (tag // (transport.MAX_VALUES + 1)) % 2 == transport.GRADIENT:
            key = (tuple(tensor.shape), tensor.dtype)
            if key not in self._gradients:
                self._gradients[key] = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(0),
                                                   dtype=tensor.dtype) * 1e-3
            tensor.copy_(self._gradients[key])
        else:
            tensor.zero_()
        return tensor

    def irecv(self, tensor, src, tag):
        self.recv(tensor, src, tag)
        return Done()


def _stand_alone_pipeline():
    """pt.Pipeline without the check that the first and last ranks agree on the batch
    (each rank here runs alone, given the batch it needs)."""
    from ..parallel.pipeline.engine import Pipeline

    class Alone(Pipeline):
        def _check_batch(self, inputs, targets):
            return None
    return Alone


def _feeds(stage_index, values_per_microbatch):
    """{tag: [what arrives under it, micro-batch after micro-batch]}: the activations
    into stage ``stage_index`` as the stage before sends them (a header, then each tensor)."""
    import torch

    from ..parallel.pipeline import transport
    feeds = collections.defaultdict(list)
    for values in values_per_microbatch:
        head, tensors = transport._describe(values, f"stage {stage_index}")
        feeds[transport.tag(stage_index, transport.ACTIVATION, 0)].append(head)
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()
            feeds[transport.tag(stage_index, transport.ACTIVATION, 1 + i)].append(
                t.view(torch.uint8) if t.dtype == torch.bool else t)
    return feeds


@dataclasses.dataclass(frozen=True)
class RankActions:
    """One rank's F, B and W, seconds a micro-batch (W is 0 where the schedule runs it
    inside B, at once), and its step's spread from one step to the next."""
    F: float
    B: float
    W: float
    jitter: float = 0.0

    @property
    def total(self):
        return self.F + self.B + self.W


class StageActions(timing.Timed):
    """Seconds of the slowest rank's compute a step (a Timed: its median over the steps
    and their spread), with ``ranks``, every rank's RankActions, and ``microbatches``."""

    @classmethod
    def of_ranks(cls, ranks, microbatches):
        slowest = max(ranks, key=lambda r: r.total)
        made = cls.of(microbatches * slowest.total, slowest.jitter)
        made.ranks, made.microbatches = tuple(ranks), microbatches
        return made

    def scaled(self, ratio, spread=None):
        """Every rank's actions ``ratio`` times as long; their spread ``spread`` of each
        rank's step if given, else scaled alike."""
        return StageActions.of_ranks([RankActions(r.F * ratio, r.B * ratio, r.W * ratio,
                                                  self.microbatches * r.total * ratio * spread if spread is not None
                                                  else r.jitter * ratio) for r in self.ranks], self.microbatches)

    @property
    def mean_step_s(self):
        """The ranks' mean compute a step: what a run's compute_seconds averages to."""
        return self.microbatches * statistics.fmean(r.total for r in self.ranks)


def stand_in_pipelines(task, microbatch, stages, schedule, microbatches, tp=1):
    """(inputs, targets, [every rank's pt.Pipeline over StandInNeighbours]) of ``task``'s
    model in a ``stages``-rank pipeline under ``schedule``, ``microbatches`` micro-batches
    of ``microbatch`` samples a step, each stage cut across ``tp`` ranks first: cut and
    built as paratrain train --strategy pipeline builds them, every rank from its own
    copy of the model, each rank past the first fed what the stages before it send."""
    import torch

    from ..parallel.pipeline.split import choose_cut, split
    from ..train.strategies.pipeline import _loss_of, _sample_inputs
    sample = _sample_inputs(task, microbatch)
    points = choose_cut(copy.deepcopy(task.model), stages, sample=sample, group=StandInNeighbours(0, stages))
    x, y = next(iter(torch.utils.data.DataLoader(task.train_set, batch_size=microbatch * microbatches,
                                                 shuffle=False, drop_last=True)))
    built = [split(cut_copy(task, tp), group=StandInNeighbours(r, stages), split_points=points, sample=sample,
                   verbose=False) for r in range(stages)]
    arriving, values = [], [v if isinstance(v, tuple) else (v,) for v in x.chunk(microbatches)]
    with torch.no_grad():   # what each stage receives: the stages before it, run on each micro-batch
        for stage in built:
            arriving.append(values)
            values = [out if isinstance(out, tuple) else (out,) for out in (stage(*v) for v in values)]
    Alone, loss_fn = _stand_alone_pipeline(), _loss_of(task)
    return x, y, [Alone(stage, group=StandInNeighbours(r, stages, _feeds(r, arriving[r]) if r else None),
                        microbatches=microbatches, schedule=schedule, loss_fn=loss_fn)
                  for r, stage in enumerate(built)]


RANK_TIMEOUT_S = 300   # seconds a forked rank may take for all its steps


def _rank_steps(pipe, optimizer, x, y, steps, turn, done, out):
    """In a forked process: ``steps`` steps of rank ``pipe``'s stand-in pipeline, each once
    its group has the ``turn`` (the ranks of a group begin together), its optimizer's step
    after it (untimed), then the group's barrier ``done``, which hands the turn on; each
    step's seconds and its F, B and W seconds into ``out`` (4 a step)."""
    import torch
    torch.set_num_threads(1)
    for i in range(steps):
        if not turn.acquire(timeout=RANK_TIMEOUT_S):
            raise RuntimeError(f"the ranks timed before this one did not finish their step in {RANK_TIMEOUT_S} s")
        t0 = time.perf_counter()
        pipe.step(x if pipe.stage.is_first else None, y if pipe.stage.is_last else None)
        took = time.perf_counter() - t0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        spans = collections.Counter()
        for kind, _mb, _c, began, ended in pipe.timeline:
            spans[kind] += ended - began
        out[4 * i:4 * i + 4] = [took] + [spans[kind] / sum(spans.values()) * took for kind in "FBW"]
        done.wait()


def _hand_over(turn, ranks):
    for _ in range(ranks):
        turn.release()


def _run_in_turns(ranks, steps, together):
    """Each of ``ranks`` ((pipe, optimizer, x, y)) in a forked process of its own, ``together``
    of them computing at once: the ranks in groups of ``together``, the groups taking turns
    a step at a time (so the host's pace falls on all alike), a group's ranks beginning
    each step together; [[(seconds, F, B, W) a step] a rank]. Nothing is pickled: the
    processes inherit the pipelines and write their timings into shared memory."""
    import functools
    import multiprocessing
    import multiprocessing.connection
    fork = multiprocessing.get_context("fork")
    groups = [list(range(first, min(first + together, len(ranks)))) for first in range(0, len(ranks), together)]
    turns = [fork.Semaphore(0) for _ in groups]
    dones = [fork.Barrier(len(group), timeout=RANK_TIMEOUT_S,
                          action=functools.partial(_hand_over, turns[(g + 1) % len(groups)],
                                                   len(groups[(g + 1) % len(groups)])))
             for g, group in enumerate(groups)]
    outs = [fork.Array("d", 4 * steps, lock=False) for _ in ranks]
    procs = [fork.Process(target=_rank_steps, args=(*ranks[r], steps, turns[g], dones[g], outs[r]), daemon=True)
             for g, group in enumerate(groups) for r in group]
    for p in procs:
        p.start()
    _hand_over(turns[0], len(groups[0]))
    deadline, running = time.monotonic() + RANK_TIMEOUT_S, list(procs)
    while running and time.monotonic() < deadline and all(p.exitcode in (None, 0) for p in procs):
        ended = multiprocessing.connection.wait([p.sentinel for p in running], deadline - time.monotonic())
        for p in running:
            if p.sentinel in ended:
                p.join()   # its sentinel closes a moment before its exit code can be read
        running = [p for p in running if p.sentinel not in ended]
    forked.end(procs, 0)   # any still running: one failed (the others would wait for it) or time ran out
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a process timing a pipeline's ranks failed or did not finish {steps} steps in "
                           f"{RANK_TIMEOUT_S} s (exit codes {[p.exitcode for p in procs]}; a negative one is "
                           f"the signal that ended it); its traceback, if it raised, is above")
    return [[tuple(out[4 * i:4 * i + 4]) for i in range(steps)] for out in outs]


def seconds(task, microbatch, stages, schedule, microbatches, tp=1, warmup=2, timed=7, together=1):
    """StageActions of ``task``'s model in a ``stages``-rank pipeline under ``schedule`` with
    ``microbatches`` micro-batches of ``microbatch`` samples (each stage cut across ``tp``
    ranks, as paratrain train --pp --tp runs it): ``timed`` steps of every rank's
    stand_in_pipelines after ``warmup``, a rank's actions each step scaled to the step's
    whole time (what the engine does between them is the rank's too). Each rank runs in
    a process of its own, ``together`` of them at once (as many as compute at once on
    this host in a run) in place of as many of the processes computing beside the
    timing (timing.in_place_of_neighbours), in turns with the others if more."""
    from ..train.optimizer import make_optimizer
    x, y, pipes = stand_in_pipelines(task, microbatch, stages, schedule, microbatches, tp)
    ranks = [(pipe, make_optimizer(task.defaults["optimizer"], pipe.stage.parameters(), task.defaults["lr"]), x, y)
             for pipe in pipes]
    together = max(1, min(together, stages))
    with timing.in_place_of_neighbours(together - 1):
        steps = _run_in_turns(ranks, warmup + timed, together)
    out = []
    for kept in (s[warmup:] for s in steps):
        per_kind = {kind: statistics.median(step[1 + i] for step in kept) / microbatches
                    for i, kind in enumerate("FBW")}
        out.append(RankActions(**per_kind, jitter=timing.Timed([step[0] for step in kept]).jitter))
    return StageActions.of_ranks(out, microbatches)
