"""What the workers of one ``paratrain train`` job tell each other besides
gradients: when the training loop starts, who takes the next batch, and at the
end, each worker's numbers for the summary.

How many batches a worker processes
-----------------------------------
``--steps N`` on W workers means N x W batches for the job. With all-reduce,
and with the parameter server under BSP, the workers move in lockstep (every
step, or every clock, waits for all of them), so each one simply takes
exactly N (``Lockstep``). Sharing a pool there would buy nothing and could
deadlock: if the pool ran out in the middle of a clock round, the workers that
got a batch would wait for the round's missing pushes of those that did not.

Under ASP and SSP nobody waits for everyone, so the N x W batches are a pool
the workers draw from (``SharedPool``): a fast worker processes more of them
and the job's throughput can be compared across consistency models. The pool
is one counter in torch.distributed's TCPStore, advanced with its atomic
``add()``: a worker takes a ticket per batch and stops at the first ticket
>= N x W, so the batches processed sum to N x W exactly. A worker keeps
reading its own DistributedSampler shard (into the next epoch when it is
through), so which samples a ticket stands for depends on who took it.

The store, and why rank 0 must stay last
----------------------------------------
A parameter-server worker does not call ``pt.init()``, so the MASTER_ADDR and
MASTER_PORT that the launcher sets are free: rank 0 serves the TCPStore there
(comm/rendezvous.py makes it, with its errors) and the others connect. The
same store carries a start barrier and, at the end, one small JSON report per
worker, which rank 0 gathers. Because rank 0 hosts the store, it must not exit
while another worker may still use it: it waits until every report is in. A
worker that was killed (``--worker-failure continue``) never reports; rank 0
gives up on it once its heartbeat (a key each worker refreshes about every
half second) has not moved for a while, and the summary names it. A ticket
that worker had taken is lost with it, so the others then process at most one
batch fewer than N x W. If rank 0 itself dies the store goes with it and the
job cannot continue: the other workers fail at their next ticket.

With all-reduce the reports travel through the process group instead
(``GroupBoard``: an all_gather of a few numbers), the channel those workers
already share.

Stopping on a wall-clock budget
-------------------------------
``paratrain compare --budget`` gives every strategy the same seconds. Workers
in lockstep must stop after the same number of batches, or the last ones
wait for a collective the others never join, so they agree (``agree_stop``):
over the process group, a one-number MAX all-reduce each step of "my clock
is past the budget"; through the store (the parameter server under BSP, where
no worker is more than a clock ahead of another), rank 0 names the last batch
two ahead of its own and every worker reads it before taking the next. Under
ASP and SSP nobody waits for a round, so each worker stops on its own clock,
as it does when the pool runs dry.
"""
import json
import time

import torch

# The numbers each worker reports at the end, in this order (GroupBoard sends them as float64).
REPORT_FIELDS = ("rank", "batches", "compute_s", "slowdown_s", "slowed_steps", "comm_wait_s", "loop_s",
                 "last_loss", "peak_memory_mb", "peak_rss_mb")
BEAT_EVERY = 0.5   # seconds between a worker's heartbeats
STALL_MIN = 5.0    # a silent worker is given up on after max(STALL_MIN, STALL_STEPS x its mean step)
STALL_STEPS = 20
POLL = 0.02
STOP_KEY = "train/stop_after"


class Lockstep:
    """Every worker takes exactly ``steps - start`` batches."""

    shared = False

    def __init__(self, steps, start=0):
        self.left = steps - start
        self.taken = 0

    def take(self):
        if self.taken >= self.left:
            return False
        self.taken += 1
        return True


class SharedPool:
    """``total`` batches shared by all workers through a store counter (see the module's docstring)."""

    shared = True

    def __init__(self, store, total, key="train/tickets"):
        self.store, self.total, self.key = store, total, key
        self.taken = 0
        self.last_ticket = -1

    def take(self):
        try:
            ticket = self.store.add(self.key, 1) - 1   # atomic on the store's server: no two workers share one
        except Exception as e:  # torch raises DistNetworkError / DistStoreError / RuntimeError
            raise RuntimeError(f"lost the job's store while taking a batch ({str(e).splitlines()[0] if str(e) else e!r}"
                               "): rank 0 hosts it, and without rank 0 the job cannot continue") from None
        self.last_ticket = ticket
        if ticket >= self.total:
            return False
        self.taken += 1
        return True


class StoreBoard:
    """The TCPStore of a parameter-server job: start barrier, heartbeats, reports."""

    def __init__(self, store, rank, world_size, timeout):
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self._last_beat = 0.0
        self._stop_named, self._stop_at = False, None

    @classmethod
    def connect(cls, rank, world_size, timeout):
        """Rank 0 serves the store at MASTER_ADDR:MASTER_PORT, the others connect to it."""
        from ..comm import env as envmod
        from ..comm import rendezvous
        e = envmod.read_env()
        return cls(rendezvous.connect(e.master_addr, e.master_port, rank, world_size, timeout), rank, world_size,
                   timeout)

    def start(self):
        """Wait until every worker is ready to train, so the loops start together."""
        from ..comm import rendezvous
        rendezvous.wait_for_ranks(self.store, self.rank, self.world_size, self.timeout, prefix="train/start")

    def beat(self, batches, seconds, force=False):
        """Tell rank 0 this worker is alive: (batches so far, seconds in the loop). Throttled."""
        now = time.monotonic()
        if force or now - self._last_beat >= BEAT_EVERY:
            self._last_beat = now
            self.store.set(f"train/beat/{self.rank}", f"{batches} {seconds:.6f}")

    def agree_stop(self, over, done, shared):
        """Whether this worker stops after ``done`` batches, ``over`` saying its own clock is past
        the budget (see the module's docstring)."""
        if shared:
            return over
        if self.rank == 0 and over and not self._stop_named:
            self.store.set(STOP_KEY, str(done + 2))
            self._stop_named = True
        if self._stop_at is None and self.store.check([STOP_KEY]):
            self._stop_at = int(self.store.get(STOP_KEY))
        return self._stop_at is not None and done >= self._stop_at

    def gather(self, report):
        """Every worker: hand in its report. Rank 0: returns (reports by rank, lost workers),
        once all are in or the missing ones have stopped beating; others return None.
        A lost worker is {"rank", "batches_at_last_heartbeat"}."""
        self.store.set(f"train/report/{self.rank}", json.dumps(report))
        if self.rank != 0:
            return None
        reports, lost = {0: report}, []
        waiting = set(range(1, self.world_size))
        seen = {}   # rank -> (beat value, when it last changed)
        deadline = time.monotonic() + self.timeout
        while waiting:
            now = time.monotonic()
            for r in sorted(waiting):
                key = f"train/report/{r}"
                if self.store.check([key]):
                    reports[r] = json.loads(self.store.get(key))
                    waiting.discard(r)
                    continue
                beat = self._beat_of(r)
                if r not in seen or seen[r][0] != beat:
                    seen[r] = (beat, now)
                if now - seen[r][1] > _stall_limit(beat) or now > deadline:
                    lost.append({"rank": r, "batches_at_last_heartbeat": int(beat.split()[0]) if beat else 0})
                    waiting.discard(r)
            if waiting:
                time.sleep(POLL)
        return reports, sorted(lost, key=lambda x: x["rank"])

    def _beat_of(self, r):
        key = f"train/beat/{r}"
        return self.store.get(key).decode() if self.store.check([key]) else None


def _stall_limit(beat):
    """How long a worker may stay silent: STALL_STEPS of its own mean steps, at least STALL_MIN s."""
    try:
        batches, seconds = beat.split()
        mean = float(seconds) / max(1, int(batches))
    except (AttributeError, ValueError):
        mean = 0.0
    return max(STALL_MIN, STALL_STEPS * mean)


class GroupBoard:
    """All-reduce jobs: the start barrier and the reports go through the process group."""

    def __init__(self, group):
        self.group = group

    def start(self):
        self.group.barrier()

    def beat(self, batches, seconds, force=False):
        pass

    def agree_stop(self, over, done, shared):
        flag = torch.tensor([1.0 if over else 0.0], dtype=torch.float64)
        self.group.all_reduce(flag, op="max")
        return bool(flag.item())

    def gather(self, report):
        mine = torch.tensor([float(report[k]) for k in REPORT_FIELDS], dtype=torch.float64)
        out = torch.zeros(self.group.world_size * len(mine), dtype=torch.float64)
        self.group.all_gather(out, mine)
        if self.group.rank != 0:
            return None
        rows = out.view(self.group.world_size, len(mine)).tolist()
        reports = {}
        for row in rows:
            r = dict(zip(REPORT_FIELDS, row))
            for k in ("rank", "batches", "slowed_steps"):
                r[k] = int(r[k])
            reports[r["rank"]] = r
        return reports, []

