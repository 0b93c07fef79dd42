"""Another host's launcher in an elastic job (``paratrain run --nnodes N --node-rank K``, K > 0).

The first host's launcher hosts the store and forms the worlds (elastic.py's
Coordinator). Every other host's launcher follows it: what it sees of its own
workers (a death, a replacement started, an end) it appends to
``elastic/reports`` for the coordinator, and it kills a worker of its own that
the coordinator orders killed (``elastic/kill``: one declared dead because its
heartbeat stopped). Replacement ids come from a counter in the store, so they
are unique over the hosts.
"""
import os
import signal
import threading
import time

from .watch import say


def new_id(store, first_ids):
    """The next replacement's worker id: after the first workers', from a counter in the store."""
    from ..comm import elastic_rendezvous as keys
    return first_ids + store.add(keys.KEY_NEXT_ID, 1) - 1


class Follower:
    """The launcher of a host other than the first in an elastic job: it tells the
    coordinator what it sees of its own workers (they died, started or ended), through
    the store, and kills those of them the coordinator declares dead. It has the
    Coordinator's interface for the launcher: lost, started, finished, new_id, stop."""

    def __init__(self, host, port, workers, first_ids, timeout):
        from ..comm import elastic_rendezvous as keys
        from ..comm import rendezvous
        self.keys = keys
        self.store = rendezvous.connect_client(host, port, timeout)
        self.first_ids = first_ids   # every host's first workers: replacements' ids come after
        self.live, self.mine, self.per_host = set(workers), set(workers), len(workers)   # this host's
        self._kills = keys.Lines(keys.KEY_KILL)
        self._lock = threading.Lock()   # the store client: the watcher's thread and ours
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratrain-elastic-follower", daemon=True)
        self._thread.start()

    def _report(self, kind, worker_id, **more):
        with self._lock:
            self.keys.append_line(self.store, self.keys.KEY_REPORTS,
                                  {"kind": kind, "id": worker_id, "at": time.time(), **more})

    def lost(self, worker_id):
        self.live.discard(worker_id)
        self._report("lost", worker_id)

    def started(self, worker_id, replacing):
        self.live.add(worker_id)
        self.mine.add(worker_id)
        self._report("started", worker_id, replacing=replacing)

    def finished(self, worker_id):
        self.live.discard(worker_id)
        self._report("finished", worker_id)

    def room(self):
        """May a replacement start here (fewer live than this host started with)?"""
        return len(self.live) < self.per_host

    def wait_for_other_hosts(self):
        pass   # the store is the first host's

    def new_id(self):
        with self._lock:
            return new_id(self.store, self.first_ids)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self):
        while not self._stop.wait(0.25):
            try:
                with self._lock:
                    orders = self._kills.new(self.store)
            except Exception:   # the first host is gone: its workers' own waits say so
                return
            for order in orders:
                if order["id"] in self.mine:
                    say(f"paratrain run: elastic: worker {order['id']} was declared dead (no heartbeat): killed")
                    try:
                        os.kill(order["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
