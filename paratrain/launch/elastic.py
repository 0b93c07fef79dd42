"""The launcher's side of elastic training: it hosts the job's store and forms each world.

With ``paratrain run --min-workers M`` the rendezvous store must outlive any
worker, so the launcher hosts it (a torch TCPStore server in this process)
instead of rank 0. Each worker has a worker id for its whole life
(``PARATRAIN_ELASTIC``); its rank is its place in the current *generation*,
the world formed after the last change:

    elastic/generation          the generation being formed or running
    elastic/gen<g>/here/<id>    worker <id> is ready to join generation g
    elastic/gen<g>/ranks        generation g's world, {"<id>": rank}, once formed
    elastic/gen<g>/changes      what changed since the generation before: the workers lost
                                (their rank there, when the launcher saw them die) and
                                those started since (when), as JSON
    elastic/gen<g>/hosts        where each of its workers runs, {"<id>": host}
    elastic/abort               why the job cannot go on (fewer than M workers too long)
    elastic/finished            the running world finished: a worker still waiting to join leaves
    elastic/reports             other hosts' launchers: their workers started, lost, finished
    elastic/kill                to those launchers: kill this worker of yours (it hangs)
    elastic/declared            to the workers: this worker is declared dead (give up on a world with it)

A worker whose world failed (a peer died in a collective;
comm/elastic_rendezvous.py) says it is ready for the next generation and
waits. The coordinator closes a generation once every live member of the
last one (the launcher knows who is alive: it is their parent) and every
new worker that has said so is ready, and there are at least M of them:
ranks go by worker id, so survivors keep their order and a replacement
comes last. A worker lost while the world runs opens the next generation;
so does a new worker once it is ready (a replacement's start-up is not
waited for: the others go on meanwhile). The running workers see it at
their next commit (``elastic/generation`` moved).
Below M workers it waits up to ``--elastic-timeout`` for replacements,
then publishes why it gives up; no worker waits forever (Horovod's
deadlock below min-np, horovod #3494, is the case this closes).

A worker whose heartbeat stops (a hung process, or a host that stalls or
loses its link) is declared dead at once (``elastic/declared``), without
waiting for its launcher, which may be as silent as it is; the others give
up on the world it is in (comm/abandon.py).

With ``--replica-size R`` (a mesh: each data-parallel replica is R workers,
its pipeline stages and tensor-parallel parts) a world is made of whole
replicas only. A worker keeps its place in its replica (its part of the
model) for life, and a replacement takes the dead worker's. A lost worker
takes its replica out of the next world; the replica's other workers wait,
alive, until a replacement makes it whole again (then it joins like any
new worker) or the job ends (torchft's replica groups).

Across hosts (``--nnodes``) the first host's launcher hosts the store and
the coordinator; every other host's launcher follows it (elastic_follower.py).
The first host is then the one point that must stay up.
"""
import json
import os
import signal
import threading
import time
from datetime import timedelta

from .. import config
from .elastic_follower import Follower, new_id
from .warm import WarmStart
from .watch import say
from .worker import Worker

POLL = 0.01   # seconds between looks at the store


class Coordinator:
    """Hosts the store at host:port and forms the generations (a thread), from the
    worker ids the launcher reports alive (``started``) and gone (``lost``)."""

    def __init__(self, host, port, workers, min_workers, max_workers, timeout, heartbeat=4.0, local=None,
                 replica=1):
        """workers: the ids of every host's first workers; local: those this launcher
        started (default: all), whose pids it may kill; replica: workers per replica (a
        mesh's pp x tp): a world is made of whole replicas, and a worker lost takes its
        replica out of the world until a replacement takes its place."""
        from torch.distributed import TCPStore

        from ..comm import elastic_rendezvous as keys   # the keys the workers read (here: torch is loaded anyway)
        self.keys = keys
        self.store = TCPStore(host, port, None, True, timedelta(seconds=max(timeout, 60.0)),
                              wait_for_workers=False)
        self.min_workers, self.max_workers, self.timeout = min_workers, max_workers, timeout
        self.first_ids = len(workers)
        self.replica = replica
        self.slots = {w: divmod(w, replica) for w in workers}   # (replica, place in it)
        self.local = set(workers if local is None else local)
        self.reports = keys.Lines(keys.KEY_REPORTS)
        self.live = set(workers)
        self.members = set(workers)   # the last formed generation's workers (first: the ones started)
        self.generation = 0
        self.formed = {}        # generation -> {worker id: rank}
        self.done = set()       # workers that ended well
        self.changes = {"lost": [], "joined": []}   # since the last formed generation (elastic/gen<g>/changes)
        self._below_since = None
        self.heartbeat = heartbeat   # seconds of silence after which a worker is declared dead
        self._beats = {}             # worker id -> (its last beat's count, when we saw it change: monotonic, wall)
        self._silenced = set()
        self._next_beat_check = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.store.set(self.keys.key_generation(), "0")
        self._thread = threading.Thread(target=self._run, name="paratrain-elastic", daemon=True)
        self._thread.start()

    # ---- what the launcher reports -----------------------------------------------------------

    def lost(self, worker_id, at=None):
        with self._lock:
            self._lost(worker_id, at)

    def started(self, worker_id, replacing, at=None):
        """A replacement (of worker ``replacing``): it opens the next generation itself once it is ready."""
        with self._lock:
            self.local.add(worker_id)
            self._started(worker_id, replacing, at)

    def finished(self, worker_id):
        """A worker ended well: once every member of the running world has, a worker
        still waiting to join has nothing to join (it is told, and exits)."""
        with self._lock:
            self._finished(worker_id)

    def new_id(self):
        """A replacement's worker id, unique over every host's launcher."""
        return new_id(self.store, self.first_ids)

    def room(self):
        """May a replacement start (fewer than --max-workers live)?"""
        return len(self.live) < self.max_workers

    def wait_for_other_hosts(self):
        """This host's workers have ended: the others', still running or finishing, need the
        store for as long as they do. Wait until none is live (ended, lost or declared dead
        when its heartbeat stops); one that never sent a heartbeat never started."""
        while not self._stop.wait(POLL * 10):
            with self._lock:
                if not [w for w in self.live - self.local if w in self._beats]:
                    return

    def _lost(self, worker_id, at=None):
        if worker_id not in self.live:   # declared dead already (its heartbeat), or ended
            return
        self.live.discard(worker_id)
        rank = self.formed.get(max(self.formed, default=-1), {}).get(str(worker_id))
        self.changes["lost"].append({"id": worker_id, "rank": rank, "at": at or time.time()})
        if self.generation in self.formed:
            self._next_generation()

    def _started(self, worker_id, replacing, at=None):
        """With replicas, the new worker takes the dead one's place; else it comes after the others."""
        self.slots[worker_id] = self.slots[replacing] if self.replica > 1 else (worker_id, 0)
        self.live.add(worker_id)
        self.changes["joined"].append({"id": worker_id, "at": at or time.time()})

    def _finished(self, worker_id):
        self.live.discard(worker_id)
        self.done.add(worker_id)
        if self.members <= self.done:
            self.store.set(self.keys.KEY_FINISHED, "1")

    def _read_reports(self):
        """What the other hosts' launchers saw (Follower)."""
        for r in self.reports.new(self.store):
            if r["kind"] == "lost":
                self._lost(r["id"], r["at"])
            elif r["kind"] == "started":
                self._started(r["id"], r["replacing"], r["at"])
            else:
                self._finished(r["id"])

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    # ---- forming generations -------------------------------------------------------------------

    def _next_generation(self):
        self.generation += 1
        self.store.set(self.keys.key_generation(), str(self.generation))

    def _ready(self, generation, live):
        return {w for w in live if self.store.check([self.keys.key_here(generation, w)])}

    def _run(self):
        while not self._stop.wait(POLL):
            with self._lock:
                self._read_reports()
                self._check_beats(time.monotonic())
                g, live = self.generation, set(self.live)
                if g in self.formed:
                    # a worker saw its world fail before we saw the death, or a new one is ready
                    # (and, with replicas, completes one)
                    if self._ready(g + 1, live) or \
                            self._complete((self.members & live) | self._ready(g, live - self.members)) - self.members:
                        self._next_generation()
                    continue
                ready = self._ready(g, live)
                expected = self._complete((self.members & live) | (ready - self.members))
                if len(expected) < self.min_workers:
                    self._wait_for_workers(expected)
                    continue
                self._below_since = None
                if expected <= ready:
                    if self._parts_lost(expected):
                        continue
                    self._form(g, self._order(expected)[:self.max_workers // self.replica * self.replica])

    # ---- replicas (--replica-size R): a world is whole replicas, each worker in its place ----

    def _replicas(self, workers):
        """{replica: the set of ``workers`` in it}."""
        out = {}
        for w in workers:
            out.setdefault(self.slots[w][0], set()).add(w)
        return out

    def _complete(self, workers):
        """Those of ``workers`` whose replica is whole among them (all of them when R = 1)."""
        if self.replica == 1:
            return set(workers)
        return {w for r in self._replicas(workers).values() if len({self.slots[v][1] for v in r}) == self.replica
                for w in r}

    def _parts_lost(self, workers):
        """With replicas: a new world needs one replica that was whole in the last one, the
        holder of every part's state; if none is left, the job ends, saying why."""
        if self.replica == 1 or not self.formed or any(r <= self.members for r in self._replicas(workers).values()):
            return False
        if not self.store.check([self.keys.KEY_ABORT]):
            self.store.set(self.keys.KEY_ABORT, "every replica of the last world lost a worker before the next "
                           "world formed: the state of their parts is gone (run more replicas, --dp)")
        return True

    def _order(self, workers):
        """The ranks of a new world: replicas that were whole in the last world first (so
        rank 0, and each place's first rank, holds a state to give), then the others; by
        replica, then by place in it (a worker keeps its place: its part of the model)."""
        replicas = self._replicas(workers)
        order = sorted(replicas, key=lambda r: (not replicas[r] <= self.members, r))
        return [w for r in order for w in sorted(replicas[r], key=lambda w: self.slots[w][1])]

    def _check_beats(self, now):
        """A live worker whose heartbeat has not moved for ``heartbeat`` seconds hangs: it is
        declared dead at once (the others are told, and give up on the world it is in),
        and killed: here by its pid, on another host by its launcher (elastic/kill), if
        that launcher is not as silent as its worker.
        Its silence is timed by this process's clock, from when the beat last changed."""
        if now < self._next_beat_check:
            return
        self._next_beat_check = now + min(0.25, self.heartbeat / 10)
        for w in self.live - self._silenced:
            beat = self.keys.read_beat(self.store, w)
            if beat is None:
                continue   # not connected yet: its start-up is not timed here
            seen = self._beats.get(w)
            if seen is None or seen[0] != beat[0]:
                self._beats[w] = (beat[0], now, time.time())
            elif now - seen[1] > self.heartbeat:
                self._silenced.add(w)
                why = f"no heartbeat for {now - seen[1]:.1f}s (more than {self.heartbeat:g}s)"
                say(f"paratrain run: elastic: worker {w} sent {why}: declared dead, and killed")
                self.keys.append_line(self.store, self.keys.KEY_DECLARED, {"id": w, "why": why})
                self._lost(w, at=seen[2])   # it went silent after its last beat: the events count from there
                if w in self.local:
                    try:
                        os.kill(beat[1], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                else:
                    self.keys.append_line(self.store, self.keys.KEY_KILL, {"id": w, "pid": beat[1]})

    def _form(self, g, members):
        ranks = {str(w): r for r, w in enumerate(members)}
        self.formed[g] = ranks
        self.members = set(members)
        changes = {"lost": self.changes["lost"],
                   "joined": [{**j, "rank": ranks[str(j["id"])]} for j in self.changes["joined"]
                              if j["id"] in self.members]}
        self.changes = {"lost": [], "joined": [j for j in self.changes["joined"] if j["id"] not in self.members]}
        hosts = {str(w): self.store.get(self.keys.key_here(g, w)).decode() for w in members}
        self.store.set(self.keys.key_changes(g), json.dumps(changes))
        self.store.set(self.keys.key_hosts(g), json.dumps(hosts))
        self.store.set(self.keys.key_ranks(g), json.dumps(ranks))   # last: a worker reads it first
        if g:
            say(f"paratrain run: elastic: generation {g}: {len(members)} workers (ids {members})")

    def _wait_for_workers(self, workers):
        now = time.monotonic()
        if self._below_since is None:
            self._below_since = now
            say(f"paratrain run: elastic: {len(workers)} workers, below --min-workers "
                     f"{self.min_workers}; waiting up to {self.timeout:g}s for more")
        elif now - self._below_since > self.timeout and not self.store.check([self.keys.KEY_ABORT]):
            why = (f"the job had {len(workers)} workers, below --min-workers {self.min_workers}, for "
                   f"{self.timeout:g}s (--elastic-timeout): no replacement came")
            self.store.set(self.keys.KEY_ABORT, why)


def add_options(parser, workers_flag, replica_flag=True):
    """The elastic flags ``paratrain run`` and ``paratrain train`` share (checked by check_sizes);
    ``paratrain train`` knows its replicas' size from its layout (replica_flag=False)."""
    parser.add_argument("--min-workers", type=int, default=None, metavar="M",
                        help="elastic training (pt.elastic): the job goes on while at least M workers live, the "
                             "world re-formed without a worker that died; the launcher hosts the rendezvous")
    parser.add_argument("--max-workers", type=int, default=None, metavar="N",
                        help=f"elastic: at most N workers (default {workers_flag})")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="elastic: start a replacement for a worker that dies, at most K times in all; it joins "
                             "the running job at its next commit and takes the state from a live worker (default 0)")
    if replica_flag:
        parser.add_argument("--replica-size", type=int, default=1, metavar="R",
                            help="elastic, for a mesh: the workers come in data-parallel replicas of R (pp x tp); a "
                                 "lost worker takes its replica out of the world until a replacement comes "
                                 "(default 1)")
    parser.add_argument("--elastic-timeout", type=float, default=None, metavar="S",
                        help="elastic: seconds to wait for at least --min-workers workers before the job ends "
                             "with an error (PARATRAIN_ELASTIC_TIMEOUT, default 600)")


def check_sizes(min_workers, workers, max_workers, max_restarts, timeout, workers_flag, replica=1):
    """A message for elastic sizes that cannot work, or None (``paratrain run`` and ``train``)."""
    top = workers if max_workers is None else max_workers
    if not 1 <= min_workers <= workers <= top:
        return (f"elastic: need 1 <= --min-workers ({min_workers}) <= {workers_flag} ({workers}) <= --max-workers "
                f"({top})")
    if replica < 1:
        return f"--replica-size must be 1 or more, got {replica}"
    for name, n in (("--min-workers", min_workers), (workers_flag, workers), ("--max-workers", top)):
        if n % replica:
            return f"elastic: {name} ({n}) must be a whole number of replicas of {replica} workers (--replica-size)"
    if max_restarts < 0:
        return f"--max-restarts must be 0 or more, got {max_restarts}"
    if timeout is not None and not timeout > 0:
        return f"--elastic-timeout must be a positive number of seconds, got {timeout:g}"
    return None


def start_coordinator(args, port, base):
    """Elastic: on the first host, the store the workers meet at, hosted here, and the
    generations formed (Coordinator); on another, a Follower of the first host's. Every
    worker is told its id. Returns (coordinator or follower, problem)."""
    timeout = args.elastic_timeout if args.elastic_timeout is not None else 600.0
    heartbeat = config.get("PARATRAIN_ELASTIC_HEARTBEAT")
    base["PARATRAIN_ELASTIC_TIMEOUT"] = repr(timeout)
    base["PARATRAIN_ELASTIC_HEARTBEAT"] = repr(heartbeat)
    first = range(args.node_rank * args.nproc, (args.node_rank + 1) * args.nproc)
    if args.node_rank > 0:
        from ..comm import rendezvous
        try:
            return Follower(args.master_addr, port, first, args.nnodes * args.nproc, timeout), None
        except rendezvous.RendezvousError as e:
            return None, f"elastic: {e}"
    try:
        return Coordinator(args.master_addr, port, range(args.nnodes * args.nproc), args.min_workers,
                           args.max_workers or args.nnodes * args.nproc, timeout, heartbeat, local=first,
                           replica=args.replica_size), None
    except Exception as e:   # torch's store: the port taken between our check and its bind
        return None, f"could not host the elastic rendezvous on {args.master_addr}:{port}: {e}"


class Replacements:
    """--max-restarts: a new worker, with a new worker id, in place of one that died, at
    most K times in all; it joins the running job. ``env(local_rank, worker_id)``: its
    environment."""

    def __init__(self, args, cmd, on_line, cpus, coordinator, env):
        self.args, self.cmd, self.env = args, cmd, env
        self.on_line, self.cpus, self.coordinator = on_line, cpus, coordinator
        self.warm = WarmStart(env(0, 0)) if not config.get("PARATRAIN_FORKSERVER") and args.threads == 1 else None
        self.left = args.max_restarts

    def stop(self):
        if self.warm is not None:
            self.warm.stop()

    def __call__(self, dead):
        if self.left <= 0 or not self.coordinator.room():
            return None
        self.left -= 1
        wid = self.coordinator.new_id()
        w = Worker(wid, dead.local_rank, self.cmd, self.env(dead.local_rank, wid), prefix=self.args.prefix,
                   on_line=self.on_line, cpus=self.cpus[dead.local_rank])
        if self.warm is not None and self.warm.ready():
            w.forkserver = self.warm.address
        w.start()
        w.start_output()
        self.coordinator.started(wid, replacing=dead.rank)
        say(f"paratrain run: elastic: started worker {wid} in place of {dead.label} "
            f"({self.left} restart{'s' if self.left != 1 else ''} left)")
        return w
