"""BSP, ASP and SSP as one rule over the workers' clocks.

Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel
Parameter Server", NIPS 2013, sec. 2: every worker keeps a clock c_w, the number
of clock() calls it has made (it starts at 0; after finishing step t it calls
clock() and is at t + 1). With staleness s, a worker at clock c may read only
while

    c - min_w c_w <= s

and it is then guaranteed to see every worker's updates from clocks < c - s:
a worker at clock c_w >= c - s has pushed the updates of all its clocks before
c_w (it pushes before it clocks). It may see newer ones too, since the server
applies updates as they arrive ("read-my-writes" plus best effort in the paper).

- SSP: any s >= 0. The fastest worker runs at most s clocks ahead of the
  slowest, so it neither waits at every step (BSP) nor reads arbitrarily old
  weights (ASP); the paper's Theorem 1 bounds the regret for bounded s.
  SSP applies each push on arrival, as the paper's SSPTable does: smaller,
  fresher steps than one round applied per clock from gradients up to s clocks
  old (benchmarks/stale_gradients.py compares the two).
- BSP: s = 0, and the server applies one *aggregated* update per clock, once
  every active worker has pushed for it (``aggregate_ready``). The aggregation
  is what makes BSP equal synchronous data parallelism (Valiant's bulk
  synchronous model, CACM 1990); the clock rule is the same as SSP's.
- ASP: s = infinity; no one ever waits (Hogwild-like, Recht et al., NIPS 2011).

Pure logic: no threads, sockets or time. The server calls it under its own lock
(or from its single-threaded loop) and decides what to do with a ``False``.
"""
import collections
import math
import operator

MODES = ("bsp", "asp", "ssp")
LOG_LIMIT = 100_000   # clock events kept for tests and reports; a long run keeps the latest


def effective_mode(mode, staleness):
    """(mode, staleness) as the servers run it: SSP with s = 0 *is* BSP (Ho et al.,
    sec. 2: "SSP with s = 0 reduces to BSP"), so it takes BSP's aggregated update
    and equals synchronous data parallelism, not merely BSP's clock rule; with
    s = infinity no worker ever waits, which is ASP."""
    if mode == "ssp" and _as_int(staleness) == 0:
        return "bsp", None
    if mode == "ssp" and staleness == math.inf:
        return "asp", None
    return mode, staleness


def valid_staleness(staleness):
    """Is ``staleness`` an SSP bound: an int >= 0, or math.inf (unbounded: ASP)?"""
    return staleness == math.inf or (_as_int(staleness) is not None and staleness >= 0)


def _as_int(x):
    """x as an int if it is one (a numpy integer too, a bool or float not), else None."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


class Clocks:
    """The clocks of ``workers`` workers under ``mode`` ("bsp", "asp", "ssp";
    ``staleness`` is required for ssp, an int >= 0).

    Workers that ``finish`` (left the job) no longer hold others back: they are
    left out of ``min_clock``. Each ``advance`` is recorded in ``log`` as
    (worker, new clock); each ``record_read`` adds its lag c - min_clock to the
    staleness histogram.
    """

    def __init__(self, workers, mode, staleness=None):
        if _as_int(workers) is None or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if mode == "ssp":
            if _as_int(staleness) is None or staleness < 0:
                raise ValueError(f"ssp needs an int staleness >= 0 (0 behaves like BSP), got {staleness!r}")
            self.staleness = _as_int(staleness)
        elif mode == "bsp":
            if staleness not in (None, 0):
                raise ValueError(f"bsp means staleness 0, got staleness={staleness!r}: use mode='ssp' for s > 0")
            self.staleness = 0
        else:
            if staleness not in (None, math.inf):
                raise ValueError(f"asp means unbounded staleness, got staleness={staleness!r}: "
                                 "use mode='ssp' for a bound")
            self.staleness = math.inf
        self.workers = _as_int(workers)
        self.mode = mode
        self.clocks = [0] * self.workers
        self.done = set()
        self.log = collections.deque(maxlen=LOG_LIMIT)
        self._hist = collections.Counter()

    def _check(self, worker):
        w = _as_int(worker)
        if w is None or not 0 <= w < self.workers:
            raise ValueError(f"unknown worker {worker!r}: workers are 0..{self.workers - 1}")
        return w

    def active(self):
        """The workers that have not finished, in order."""
        return [w for w in range(self.workers) if w not in self.done]

    def advance(self, worker):
        """``worker`` finished a step: its clock moves to the next; returns it."""
        w = self._check(worker)
        if w in self.done:
            raise ValueError(f"worker {w} has finished (at clock {self.clocks[w]}) and cannot clock again")
        self.clocks[w] += 1
        self.log.append((w, self.clocks[w]))
        return self.clocks[w]

    def observe(self, worker, clock):
        """A request from ``worker`` carried ``clock``: its clock is at least that.
        Usually the server has already counted every clock() before the request, so
        this changes nothing. When a clock message comes after a request it preceded
        (one sent through ZeroMQ, the other rung on the doorbell), or after a server
        restarted from a checkpoint (the clock messages since it were lost with the
        old server), it brings the clock up to date and logs the advances it stands
        for, so the clock log misses none."""
        w = self._check(worker)
        if clock > self.clocks[w]:
            self.log.extend((w, c) for c in range(self.clocks[w] + 1, int(clock) + 1))
            self.clocks[w] = int(clock)

    def state(self):
        """What a checkpoint keeps: plain lists and numbers."""
        return {"clocks": list(self.clocks), "done": sorted(self.done), "histogram": {str(k): v for k, v in
                                                                                      self._hist.items()}}

    def load(self, state):
        clocks = [int(c) for c in state["clocks"]]
        if len(clocks) != self.workers:
            raise ValueError(f"checkpoint has clocks of {len(clocks)} workers, this job has {self.workers}")
        self.clocks = clocks
        self.done = {self._check(w) for w in state["done"]}
        self._hist = collections.Counter({int(k): int(v) for k, v in state.get("histogram", {}).items()})

    def clock_of(self, worker):
        return self.clocks[self._check(worker)]

    def min_clock(self):
        """The slowest active worker's clock; once all have finished, the last
        clock anyone reached (nobody is left to wait for)."""
        active = [self.clocks[w] for w in self.active()]
        return min(active) if active else max(self.clocks)

    def may_read(self, worker):
        """Ho et al. sec. 2: a worker at clock c reads only while c - min_clock <= s."""
        return self.clocks[self._check(worker)] - self.min_clock() <= self.staleness

    def blocking_workers(self, worker):
        """The active workers whose clocks hold ``worker`` back (c_w < c - s), in
        index order; empty exactly when it may read (ASP: always empty)."""
        limit = self.clocks[self._check(worker)] - self.staleness
        return [w for w in self.active() if self.clocks[w] < limit]

    def finish(self, worker):
        """``worker`` left: it no longer holds the others back. Finishing twice is harmless."""
        self.done.add(self._check(worker))

    def record_read(self, worker, lag=None):
        """Count a read in the staleness histogram: how many clocks the reader is
        ahead of the slowest active worker (0 for a finished worker behind them),
        or the ``lag`` the caller knows better (BSP: the reader's clock minus the
        rounds applied, 0 by construction, where the slowest worker's clock message
        may simply not have arrived yet). Returns that lag."""
        self._check(worker)
        lag = max(0, self.clocks[worker] - self.min_clock() if lag is None else lag)
        self._hist[lag] += 1
        return lag

    def histogram(self):
        """{lag: number of reads}, by lag."""
        return dict(sorted(self._hist.items()))

    def aggregate_ready(self, clock, pushed_workers):
        """BSP: may the server apply the aggregated update of ``clock``? Yes once
        every active worker has pushed for it (``pushed_workers``; at least one).
        A worker that finished is not waited for; one that pushed and then
        finished still counts in the average. The rule needs no more than the
        set, since a worker's push reaches the server before its clock does;
        ``clock`` is checked and names the round being gathered."""
        if clock < 0:
            raise ValueError(f"clock must be >= 0, got {clock}")
        pushed = {self._check(w) for w in pushed_workers}
        return bool(pushed) and all(w in pushed for w in self.active())
