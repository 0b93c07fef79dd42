"""How a part of a step is timed here: on one thread, with the job's other workers computing
beside it, once until the host's speed is said to have moved, and at one pace.

here.py times the parts a prediction needs (a whole step, a pipeline's stages, a cut
model's step, a compressor, the optimizer); this file is how each is timed: ``once``
runs a ``measure()`` under ``one_thread`` and ``neighbours`` and keeps it per key until
``forget_timings``, the median of a few timings each brought to the pace of the first
part timed (``pace_seconds``); ``paired`` times a part that runs step after step (a cut
model's, ZeRO-3's, a parameter-server worker's) each step just after a whole step
instead, and keeps the median of their ratios at that pace. A step's seconds come back
as a ``Timed`` (the median, and its spread from one step to the next, which waits.py
charges).
"""
import contextlib
import functools
import statistics
import time

from . import forked, waits

# A gpt step here varies by 10-15% from step to step and its median over 25 steps by 5%
# from one stretch of seconds to the next: 20 steps after 5 put the timing's median
# within a few percent of a run's.
WARMUP, TIMED = 5, 20


def training_steps(task, batch_size, model=None, copied=True, sample=None):
    """Seconds of each step, forever: forward, backward and the task's optimizer step on
    ``batch_size`` samples, on a copy of ``model`` (else the task's own), left as it was;
    with ``copied`` False on the model itself (footprint.py: a copy's parameters would
    count in the heap it measures). ``sample()``, if given, is called where the trainer
    samples the heap: after backward and after the optimizer's step."""
    import copy

    from ..train.optimizer import make_optimizer
    model = task.model if model is None else model
    if copied:
        model = copy.deepcopy(model)
    optimizer = make_optimizer(task.defaults["optimizer"], model.parameters(), task.defaults["lr"])
    for batch in batches(task, batch_size):
        t0 = time.perf_counter()
        task.loss(model, batch).backward()
        if sample:
            sample()
        optimizer.step()
        if sample:
            sample()
        optimizer.zero_grad(set_to_none=True)
        yield time.perf_counter() - t0


def batches(task, batch_size):
    """The task's training batches of ``batch_size`` samples in order, over and over."""
    import torch
    while True:
        yield from torch.utils.data.DataLoader(task.train_set, batch_size=batch_size, shuffle=False, drop_last=True)


class Timed(float):
    """A step's seconds (the median of the timed steps, as a run's step time is reported),
    with ``jitter``, their spread from one step to the next (what waits.py charges per
    synchronization; as compare takes a run's: the host's drift across the timing left out)."""

    def __new__(cls, samples):
        timed = super().__new__(cls, statistics.median(samples))
        timed.jitter = waits.step_to_step_spread(samples)
        return timed

    @classmethod
    def of(cls, median, jitter):
        """The Timed of a median and standard deviation already taken (a run's, from its metrics)."""
        timed = super().__new__(cls, median)
        timed.jitter = jitter
        return timed

    def scaled(self, ratio):
        """These seconds and their spread ``ratio`` times as long."""
        return Timed.of(float(self) * ratio, self.jitter * ratio)


def time_step(task, batch_size, warmup=WARMUP, timed=TIMED, model=None):
    """Seconds of a training step on ``batch_size`` samples on this process (``training_steps``;
    ``model``: another model of the task's, a cut one), a Timed of ``timed`` steps after
    ``warmup``."""
    return timed_of(training_steps(task, batch_size, model), warmup, timed)


def timed_of(seconds, warmup=WARMUP, timed=TIMED):
    """A Timed of ``timed`` of the times the generator ``seconds`` yields, after ``warmup``."""
    return Timed(after_warmup(seconds, warmup, timed))


def after_warmup(measures, warmup=WARMUP, timed=TIMED):
    """The ``timed`` values the generator ``measures`` yields after its first ``warmup``."""
    return [next(measures) for _ in range(warmup + timed)][warmup:]


_TIMED = {}
NEIGHBOUR_START_S = 120   # seconds a neighbour may take to finish its first step


def kept(key, measure):
    """``measure()`` once per ``key`` until forget_timings, as it is (a timing that needs no
    thread of its own nor neighbours: a send between two processes)."""
    if key not in _TIMED:
        _TIMED[key] = measure()
    return _TIMED[key]


def forget_timings():
    """Time the models afresh from now on (the machine's speed has moved)."""
    _TIMED.clear()


@functools.lru_cache(maxsize=None)
def task_of(model, seed=0):
    """Built-in ``model``'s task, built once (the gpt task reads its text each time it is built);
    the timings below run forward and backward on it and leave its parameters as they were."""
    from ..train.tasks import build_task
    return build_task(model, seed=seed)


@contextlib.contextmanager
def one_thread():
    """Compute on one thread, as paratrain train's workers do (--threads 1)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _compute_until(task, batch, stop, started, go, idle):
    """Training steps until ``stop``; while ``go`` is clear, none (``idle`` released once)."""
    import torch
    torch.set_num_threads(1)
    for i, _ in enumerate(training_steps(task, batch)):
        if i == 0:
            started.release()
        if not go.is_set():
            idle.release()
            go.wait()
        if stop.is_set():
            return


class _Neighbours:
    """Processes computing a step beside a timing (``processes``), each until ``stop``; the
    ones whose ``go`` event is cleared pause after their step, each releasing ``idle``."""

    def __init__(self, processes, stop, go, idle):
        self.processes, self.stop, self.go, self.idle = processes, stop, go, idle

    @contextlib.contextmanager
    def paused(self, count):
        """Within: ``count`` of them compute nothing (each is back once the body ends)."""
        held = self.go[:max(0, count)]
        for go in held:
            go.clear()
        try:
            for _ in held:
                if not self.idle.acquire(timeout=NEIGHBOUR_START_S):
                    raise RuntimeError(f"a process computing beside the timing did not pause within "
                                       f"{NEIGHBOUR_START_S} s")
            yield
        finally:
            for go in held:
                go.set()

    def close(self):
        self.stop.set()
        for go in self.go:
            go.set()
        forked.end(self.processes, 30)


def _start_neighbours(model, batch, count, seed):
    """``count`` forked processes computing built-in ``model``'s step of ``batch`` samples,
    returned (a _Neighbours) once each has finished a step."""
    import multiprocessing
    fork = multiprocessing.get_context("fork")
    stop, started, idle = fork.Event(), fork.Semaphore(0), fork.Semaphore(0)
    go = [fork.Event() for _ in range(count)]
    for event in go:
        event.set()
    others = _Neighbours([fork.Process(target=_compute_until, args=(task_of(model, seed), batch, stop, started,
                                                                    event, idle), daemon=True)
                          for event in go], stop, go, idle)
    for p in others.processes:
        p.start()
    try:
        for _ in others.processes:
            if not started.acquire(timeout=NEIGHBOUR_START_S):
                raise RuntimeError(f"a process computing beside the timing did not finish a step of {model} "
                                   f"in {NEIGHBOUR_START_S} s")
    except BaseException:
        others.close()
        raise
    return others


_BESIDE = None   # the _Neighbours computing beside the timing in progress, if any


@contextlib.contextmanager
def in_place_of_neighbours(count):
    """Within: ``count`` of the processes computing beside the timing in progress pause (a
    timing that runs processes of its own, which compute in their place)."""
    if _BESIDE is None:
        yield
        return
    with _BESIDE.paused(count):
        yield


class _Standing:
    """Inside ``standing()``: the neighbours left computing after a timing, for the next
    that asks for the same ones, and the pace last taken beside them."""

    def __init__(self):
        self.spec, self.others, self.pace = None, None, None

    def neighbours(self, spec):
        """The neighbours ``spec`` (model, batch, count, seed) asks for, started unless they run."""
        if spec != self.spec:
            self.close()
            self.others = _start_neighbours(*spec)
            self.spec = spec
        return self.others

    def close(self):
        if self.others is not None:
            self.others.close()
        self.spec, self.others, self.pace = None, None, None


_STANDING = None   # a _Standing while inside standing()


@contextlib.contextmanager
def standing():
    """Within: the parts of a prediction timed one after another share their neighbours
    (started once, instead of forked and warmed up again for each part) and their paces
    (the pace taken just after one part is the pace just before the next): each part is
    still timed beside the job's other workers, at one pace, without paying for their
    start and for a second pace each time. The neighbours stop at the end: nothing
    computes beside what runs after (a compare's training run)."""
    global _STANDING
    if _STANDING is not None:   # already inside: the outer one stops them
        yield
        return
    _STANDING = _Standing()
    try:
        yield
    finally:
        _STANDING.close()
        _STANDING = None


@contextlib.contextmanager
def neighbours(model, batch, count, seed=0):
    """``count`` forked processes computing built-in ``model``'s step of ``batch`` samples
    while the body times its own: what a worker's compute takes beside the others. The body
    starts once each has finished a step: a short timing (a pipeline stage's layers, a
    few hundred milliseconds) would otherwise be over before they compute at all. Inside
    ``standing()`` they go on computing after the body, for the next timing."""
    global _BESIDE
    if count <= 0:
        if _STANDING is not None and _STANDING.spec is not None:
            _STANDING.close()   # none beside this timing
        yield
        return
    if _STANDING is not None:
        others = _STANDING.neighbours((model, batch, count, seed))
    else:
        others = _start_neighbours(model, batch, count, seed)
    _BESIDE = others
    try:
        yield
    finally:
        _BESIDE = None
        if _STANDING is None:
            others.close()


PACE_STEPS = 4   # whole steps timed, after one warm-up, for the host's pace around each timing
# Each part is timed this many times in a row, each brought to the first pace on its own,
# and the median kept: a part and its two paces take a second or two, and one of them
# landing on a fast or slow moment of the host moved a pipeline stage's or a tensor
# worker's share of the whole step from one prediction to the next by more than the
# strategies differ.
PART_TIMINGS = 3


def pace_seconds(model, seed=0):
    """The median of a few training steps of built-in ``model``'s default batch: how fast
    this host computes just now."""
    return float(timed_of(whole_steps(model, seed), warmup=1, timed=PACE_STEPS))


PACE_FRESH_S = 1.0   # a pace taken this long before a timing still stands for the moment it starts


def _pace_before(model, seed, alongside):
    """The pace just before a timing: inside ``standing()``, the one taken just after the
    timing before it, beside the same neighbours, if that was a moment ago (a plan measures
    the model's memory between two parts)."""
    last = _STANDING.pace if _STANDING is not None else None
    if last and last[0] == (model, seed, alongside) and time.monotonic() - last[2] <= PACE_FRESH_S:
        return last[1]
    return pace_seconds(model, seed)


def at_pace(value, ratio):
    """``value`` (seconds: a float or a Timed) times ``ratio``."""
    return value.scaled(ratio) if isinstance(value, Timed) else value * ratio


def once(key, model, batch, seed, alongside, measure, paced=True):
    """``measure()`` of built-in ``model`` on one thread with ``alongside`` processes computing
    its step of ``batch`` samples beside it; once per ``key`` until forget_timings.

    A prediction adds parts timed one after another (a whole step, a pipeline's stages,
    a cut model's step, a compressor), and a shared host's speed moves within a minute: a
    stage timed at a fast moment and the whole step at a slow one rank a pipeline ahead of
    data parallelism that runs faster than it. So each part in seconds (``paced``) is
    brought to one pace: the model's step is timed briefly just before and just after it,
    and the part is scaled by the first such pace since forget_timings over the mean of
    these two, as if every part ran at that moment. The part is timed PART_TIMINGS times
    so, one after another (each one's pace after it is the next one's before), and the
    median of the paced values kept (a Timed keeps its own jitter)."""
    if key not in _TIMED:
        with one_thread(), neighbours(model, batch, alongside, seed):
            if not paced:
                if _STANDING is not None:
                    _STANDING.pace = None   # time passes: the next part takes its own pace
                return kept(key, measure)
            before = _pace_before(model, seed, alongside)
            base = _TIMED.setdefault(("pace", model, alongside), before)
            paced_values = []
            for _ in range(PART_TIMINGS):
                value = measure()
                after = pace_seconds(model, seed)
                paced_values.append(at_pace(value, base / ((before + after) / 2)))
                before = after
            if _STANDING is not None:
                _STANDING.pace = ((model, seed, alongside), after, time.monotonic())
        _TIMED[key] = statistics.median_low(paced_values)   # one of them, a Timed with its jitter
    return _TIMED[key]


PAIRS = 25   # a part's steps each timed just after a whole step, after WARMUP of each


def whole_steps(model, seed=0):
    """Seconds of each training step of built-in ``model``'s default batch, forever (the
    steps ``pace_seconds`` takes the median of)."""
    task = task_of(model, seed)
    return training_steps(task, task.defaults["batch_size"])


def interleaved(whole, part, warmup=WARMUP, pairs=PAIRS):
    """([whole step seconds], [part step seconds]) of ``pairs`` steps of each generator taken
    by turns, whole then part, after ``warmup`` of each taken the same way."""
    wholes, parts = [], []
    for _ in range(warmup + pairs):
        wholes.append(next(whole))
        parts.append(next(part))
    return wholes[warmup:], parts[warmup:]


def paired(key, model, batch, seed, alongside, part_steps):
    """A part's step (``part_steps()``: a generator of its seconds, one step after another)
    of built-in ``model`` on one thread with ``alongside`` processes computing its step of
    ``batch`` samples beside it, at one pace; once per ``key`` until forget_timings.

    ``once`` paces a part by whole steps timed before and after it, seconds apart; the
    host's speed moves within those seconds (a gpt step here took 74-92 ms at one moment
    and 201 ms minutes later), and a part timed at a fast moment put ZeRO-3 first in a
    plan where it ran 11% behind. Here each of the part's steps is timed just after a
    whole step of the model's default batch, a tenth of a second apart: the two see the
    same host, and the median of their ratios, times the first pace since forget_timings,
    is the part at that pace (a Timed: its jitter the part's own step-to-step spread)."""
    if key not in _TIMED:
        with one_thread(), neighbours(model, batch, alongside, seed):
            steps = part_steps()
            try:
                wholes, parts = interleaved(whole_steps(model, seed), steps)
            finally:
                steps.close()   # (a part's generator may hold a server or an engine)
            pace = statistics.median(wholes)
            base = _TIMED.setdefault(("pace", model, alongside), pace)
            ratio = statistics.median(p / w for w, p in zip(wholes, parts))
            if _STANDING is not None:
                _STANDING.pace = ((model, seed, alongside), statistics.median(wholes[-PACE_STEPS:]),
                                  time.monotonic())
        _TIMED[key] = Timed.of(ratio * base, waits.step_to_step_spread(parts) * base / pace)
    return _TIMED[key]

