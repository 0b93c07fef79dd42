"""A pipeline's stages timed as the engine runs them, one process standing in for every rank.

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
The ranks take turns a step at a time, so that the host's pace falls on all
of them alike, each followed by its optimizer step (untimed), as in a run.
What the stand-ins leave out is the messages themselves (pipeline.py adds a
send timed between two real stages). And taking turns in one process, the
ranks leave each other's caches cold, unlike a run's ranks, each computing
on its own core: under ZB-H1 gpt's last stage reads 11-15% dearer than its
first here, 2-4% in a run, and 4% (a median) with each rank in a process of
its own, both computing at once.
"""
import collections
import copy
import dataclasses
import statistics
import time

from . import timing
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


def seconds(task, microbatch, stages, schedule, microbatches, tp=1, warmup=2, timed=7):
    """StageActions of ``task``'s model in a ``stages``-rank pipeline under ``schedule`` with
    ``microbatches`` micro-batches of ``microbatch`` samples (each stage cut across ``tp``
    ranks, as paratrain train --pp --tp runs it), on this thread: ``timed`` steps of
    every rank's stand_in_pipelines after ``warmup``, a rank's actions each step scaled
    to the step's whole time (what the engine does between them is the rank's too)."""
    from ..train.optimizer import make_optimizer
    x, y, pipes = stand_in_pipelines(task, microbatch, stages, schedule, microbatches, tp)
    optimizers = [make_optimizer(task.defaults["optimizer"], pipe.stage.parameters(), task.defaults["lr"])
                  for pipe in pipes]
    steps = [[] for _ in pipes]
    for _ in range(warmup + timed):
        for r, (pipe, optimizer) in enumerate(zip(pipes, optimizers)):
            t0 = time.perf_counter()
            pipe.step(x if pipe.stage.is_first else None, y if pipe.stage.is_last else None)
            took = time.perf_counter() - t0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            spans = collections.Counter()
            for kind, _mb, _c, began, ended in pipe.timeline:
                spans[kind] += ended - began
            steps[r].append((took, {kind: span / sum(spans.values()) * took for kind, span in spans.items()}))
    ranks = []
    for kept in (s[warmup:] for s in steps):
        per_kind = {kind: statistics.median(parts.get(kind, 0.0) for _, parts in kept) / microbatches
                    for kind in "FBW"}
        ranks.append(RankActions(**per_kind, jitter=timing.Timed([took for took, _ in kept]).jitter))
    return StageActions.of_ranks(ranks, microbatches)
