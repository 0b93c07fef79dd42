"""A worker's side of elastic training's rendezvous: which world it is in now.

In an elastic job (``PARATRAIN_ELASTIC`` holds this worker's id) the launcher
hosts the store and forms each generation of the world (launch/elastic.py
has the rules; the keys, which both sides read, are here). ``join`` says
this worker is ready for the next generation and waits until the launcher
has formed it; pt.init() then
builds the groups of that generation under its own key prefix, so nothing
of an earlier world's set-up is read again. ``world_moved`` tells a running
world that the launcher has opened a new generation (a worker was lost or
a replacement started), which pt.elastic checks at each commit.

A ``Heartbeat`` thread says every so often that this worker's process still
runs (``elastic/beat/<id>``: a count and the pid), on a store connection of its
own. A worker that hangs (stopped, stuck holding the interpreter, or on a host
whose link is cut) stops beating, and the launcher declares it dead: a hang
becomes a failure in seconds, not a wait for the collective's timeout (pytorch
#123678). The same thread reads the declarations (``elastic/declared``) and
hands them to the worker (comm/abandon.py: it gives up on a world that holds
a declared worker, whose sockets may never close).
"""
import json
import os
import threading
import time
from datetime import timedelta

from .errors import CommError
from .rendezvous import RendezvousError

POLL = 0.01
LAUNCHER_SLACK = 30.0   # past the launcher's own timeout: it says why it gave up, this only if it is gone


def key_generation():
    return "elastic/generation"


def key_here(generation, worker_id):
    return f"elastic/gen{generation}/here/{worker_id}"


def key_ranks(generation):
    return f"elastic/gen{generation}/ranks"


def key_changes(generation):
    return f"elastic/gen{generation}/changes"


def key_beat(worker_id):
    return f"elastic/beat/{worker_id}"


def key_hosts(generation):
    return f"elastic/gen{generation}/hosts"


def key_broken(generation):
    """Set by a worker whose world failed: why. Its peers give up on that world too (a rank
    of a mesh may be waiting for one that left, not for the one that died)."""
    return f"elastic/gen{generation}/broken"


KEY_ABORT = "elastic/abort"
KEY_FINISHED = "elastic/finished"
# Append-only logs, a JSON object per line (Lines reads them):
KEY_REPORTS = "elastic/reports"     # other hosts' launchers: {"kind": "lost"|"started"|"finished", "id", "at"}
KEY_KILL = "elastic/kill"           # the coordinator to those launchers: {"id", "pid"}, a worker to kill
KEY_DECLARED = "elastic/declared"   # the coordinator to the workers: {"id", "why"}, declared dead
KEY_NEXT_ID = "elastic/next_id"     # a counter: the ids of replacements, unique over all hosts


def append_line(store, key, record):
    store.append(key, json.dumps(record) + "\n")


class Lines:
    """A reader of an append-only log: each call returns the records added since the last."""

    def __init__(self, key):
        self.key, self.offset = key, 0

    def new(self, store):
        if not store.check([self.key]):
            return []
        text = store.get(self.key).decode()
        fresh, self.offset = text[self.offset:], len(text)
        return [json.loads(line) for line in fresh.splitlines() if line]


class ElasticAbort(CommError):
    """The launcher gave up forming a world (fewer workers than --min-workers for too long)."""


def current_generation(store):
    return int(store.get(key_generation()).decode())


def join(store, worker_id, last_generation, timeout, host=""):
    """Wait to be placed in the generation after ``last_generation`` (-1: a new worker);
    returns (generation, {worker id: rank}, {worker id: host}), ids as strings; ``host``
    is this worker's (comm/env.host_id). Raises ElasticAbort if the launcher gives up
    (after ``timeout`` seconds below --min-workers), and a RendezvousError if nothing
    is heard for longer than that (the launcher is gone).

    A worker whose replica is not whole (--replica-size: a peer of its replica died)
    sees worlds formed without it, and waits for a replacement to make it whole; if
    none comes within ``timeout`` it leaves, with exit code 0: the job goes on
    without it."""
    store.set_timeout(timedelta(seconds=max(timeout, 1.0)))
    deadline = time.monotonic() + timeout + LAUNCHER_SLACK
    g = left_out = None
    while True:
        if store.check([KEY_ABORT]):
            raise ElasticAbort(f"worker {worker_id}: {store.get(KEY_ABORT).decode()}")
        if store.check([KEY_FINISHED]):   # the job ended while this worker was on its way: nothing to do
            print(f"paratrain: elastic: worker {worker_id}: the job finished before it could join", flush=True)
            raise SystemExit(0)
        if g is not None and store.check([key_ranks(g)]):
            ranks = json.loads(store.get(key_ranks(g)).decode())
            if str(worker_id) in ranks:   # ours, even if a later one is open already: the others are in it
                return g, ranks, json.loads(store.get(key_hosts(g)).decode())
            # formed without us: a replacement not counted yet (it opens the next one), or a replica not whole
            left_out = left_out or time.monotonic()
        newest = max(current_generation(store), last_generation + 1)
        if newest != g:
            g = newest
            store.set(key_here(g, worker_id), host)
            continue
        if left_out is not None and time.monotonic() - left_out > timeout:
            print(f"paratrain: elastic: worker {worker_id}: the running world has had no place for it for "
                  f"{timeout:g}s (its replica is not whole, and no replacement came): it leaves", flush=True)
            raise SystemExit(0)
        if left_out is None and time.monotonic() > deadline:
            raise RendezvousError(f"worker {worker_id}: no world was formed within {timeout + LAUNCHER_SLACK:g}s "
                                  f"of asking to join (generation {g}); is the launcher alive?")
        time.sleep(POLL)


def world_moved(store, generation):
    """Has the launcher opened a generation after ``generation``?"""
    return current_generation(store) > generation


def changes(store, generation):
    """What the launcher saw change before forming ``generation``: {"lost": [{"id", "rank",
    "at"}], "joined": [{"id", "at"}]}, "at" in seconds since the epoch (time.time())."""
    if not store.check([key_changes(generation)]):
        return {"lost": [], "joined": []}
    return json.loads(store.get(key_changes(generation)).decode())


class Heartbeat:
    """Beats ``elastic/beat/<id>`` every ``period`` seconds from a daemon thread, over the
    store client ``connect()`` makes (its own: the main thread's may be inside a long wait),
    and every WATCH_S calls ``watch(store)``, which looks for news that this worker's world
    is gone (a worker declared dead, a peer's world broken)."""

    WATCH_S = 0.1

    def __init__(self, connect, worker_id, period, watch):
        self.connect, self.key, self.period, self.watch = connect, key_beat(worker_id), period, watch
        threading.Thread(target=self._run, name="paratrain-heartbeat", daemon=True).start()

    def _run(self):
        """Beats for the life of the process (it ends with it: a daemon thread)."""
        try:
            store, count, pid, next_beat, warned = self.connect(), 0, os.getpid(), 0.0, False
            while True:
                if time.monotonic() >= next_beat:
                    count += 1
                    store.set(self.key, f"{count} {pid}")
                    next_beat = time.monotonic() + self.period
                try:
                    self.watch(store)
                except Exception as e:   # never the end of the beats: a silent worker is declared dead
                    if not warned:
                        print(f"paratrain: elastic: the heartbeat's watch failed ({e!r}); beating on", flush=True)
                    warned = True
                time.sleep(self.WATCH_S)
        except Exception:   # the launcher is gone: the main thread learns it from its own waits
            return


def read_beat(store, worker_id):
    """(count, pid) of a worker's last heartbeat, or None before its first."""
    key = key_beat(worker_id)
    if not store.check([key]):
        return None
    count, pid = store.get(key).decode().split()
    return int(count), int(pid)
