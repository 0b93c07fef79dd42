"""The flight recorder: this rank's last collectives and messages, dumped when something goes wrong.

Always on (``PARATRAIN_FLIGHT_RECORDER`` records, default 2000; 0 turns it
off), as PyTorch's Flight Recorder keeps a ring buffer of its last
collectives per rank. Each group keeps its own ring (GroupLog): a call
appends one small tuple (sequence id, op, bytes, time) to a bounded deque
and, when it ends, writes its end time and moves the group's count of
completed calls; collectives complete in sequence order (one lane per
group), so a record's state follows from that count. That is a few hundred
nanoseconds a call. Blocking sends and receives go to one more ring of
records with their peer (FlightRecorder).

The ring is dumped as JSON to ``PARATRAIN_FLIGHT_DIR/rank-<R>.json`` on a
collective's timeout, a dead peer or a mismatch (any CommError out of a
call), on SIGUSR1, and on an uncaught exception. ``paratrain trace
--flight DIR`` (flight_report.py) then lines the ranks' dumps up by
sequence id and names the first call where they part.
"""
import collections
import itertools
import json
import os
import sys
import tempfile
import threading
import time
import traceback
import weakref

from .. import config

QUEUED, STARTED, COMPLETED, FAILED = "queued", "started", "completed", "failed"
FIELDS = ("group", "seq", "op", "bytes", "peer", "state", "queued_s", "started_s", "ended_s")
GROUP, SEQ, OP, BYTES, PEER, STATE, QUEUED_S, STARTED_S, ENDED_S = range(len(FIELDS))

RING = None       # the FlightRecorder, or None when off
ask_peers = None  # set by the stall watchdog: fn(error, wait) that has the other ranks dump theirs too
GROUPS = weakref.WeakSet()   # every live group of this process, for the stall inspector's answers
_dumped = set()
_dump_numbers = itertools.count()


class GroupLog:
    """One group's last collectives: the hot path touches only these fields."""

    __slots__ = ("calls", "ends", "size", "done", "started", "failed")

    def __init__(self, size):
        self.calls = collections.deque(maxlen=size)   # (seq, op, bytes, called at, asynchronous)
        self.ends = [None] * size                     # end time of call seq, at seq % size
        self.size = size
        self.done = 0                                 # the sequence id of the last completed call
        self.started = {}                             # seq -> start time, for asynchronous calls
        self.failed = {}                              # seq -> time it failed

    def records(self, group_name):
        out = []
        for seq, op, nbytes, called, asynchronous in list(self.calls):
            if seq in self.failed:
                state, ended = FAILED, self.failed[seq]
            elif seq <= self.done:
                state, ended = COMPLETED, self.ends[seq % self.size]
            else:   # a blocking call starts when called; an asynchronous one when its lane runs it
                state, ended = (QUEUED if asynchronous and seq not in self.started else STARTED), None
            out.append({"group": group_name, "seq": seq, "op": op, "bytes": nbytes, "peer": None, "state": state,
                        "queued_s": called, "started_s": self.started.get(seq, called), "ended_s": ended})
        return out

    def run(self, seq, fn, dump_on):
        """Run call ``seq``'s body and note how it ended: completed (calls complete in
        sequence order, one lane per group), or failed, where one of ``dump_on`` dumps the ring."""
        try:
            fn()
        except BaseException as e:
            self.failed[seq] = time.time()
            if isinstance(e, dump_on):
                failed(e)
            raise
        self.ends[seq % self.size] = time.time()
        self.done = seq


def run_async(log, seq, fn, dump_on):
    """An asynchronous collective's body, noting when it starts and ends (on the lane thread)."""
    def run():
        log.started[seq] = time.time()
        log.run(seq, fn, dump_on)
        log.started.pop(seq, None)
    return run


def new_log():
    """A GroupLog for a new group, or None when the recorder is off."""
    return GroupLog(RING.size) if RING is not None else None


class FlightRecorder:
    def __init__(self, size, rank, world_size, directory):
        self.size, self.rank, self.world_size, self.directory = size, rank, world_size, directory
        self.slots = [[None] * len(FIELDS) for _ in range(size)]
        self._numbers = itertools.count()   # next() is atomic under the GIL: no lock on the hot path
        self.count = 0

    def message(self, group_name, op, nbytes, peer):
        """A blocking send or receive started: its record (returned for ``end``)."""
        n = next(self._numbers)
        self.count = n + 1
        slot = self.slots[n % self.size]
        now = time.time()
        slot[:] = (group_name, None, op, nbytes, peer, STARTED, now, now, None)
        return slot

    def records(self):
        """The records, oldest first, as dicts (a call being recorded meanwhile may show half-written)."""
        count = self.count
        n = min(count, self.size)
        rows = [list(self.slots[i % self.size]) for i in range(count - n, count)]
        return [dict(zip(FIELDS, row)) for row in rows]

    def all_records(self):
        """Every group's records and the messages', oldest first."""
        from .calls import group_name
        out = list(self.records())
        for g in list(GROUPS):
            log = getattr(g, "_flight", None)
            if log is not None:
                out += log.records(group_name(g))
        return sorted(out, key=lambda r: r["queued_s"])

    def in_flight(self):
        """The records not yet ended, oldest first."""
        return [r for r in self.all_records() if r["state"] in (QUEUED, STARTED)]


def end(slot, error=None, dump_on=()):
    """A message's record: completed, or failed with ``error`` (one of ``dump_on`` dumps the ring)."""
    slot[STATE], slot[ENDED_S] = (COMPLETED if error is None else FAILED), time.time()
    if isinstance(error, dump_on):
        failed(error)


def failed(e):
    """A call raised one of the errors that end a job (comm/ passes its CommError: a
    timeout, a dead peer, a mismatch): dump the ring, and the error says where."""
    if RING is not None:
        try:
            path = dump(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        except OSError as why:   # the error being reported matters more than its dump
            print(f"paratrain: the flight recorder could not be written: {why}", file=sys.stderr, flush=True)
            return
        if path and ask_peers is not None:
            ask_peers(e, wait=False)   # (a caught error must not be slowed; an uncaught one waits, below)
        if path and hasattr(e, "add_note") and not getattr(e, "_flight_noted", False):
            e.add_note(f"flight recorder: {path} (read every rank's with `paratrain trace --flight "
                       f"{os.path.dirname(path)}`)")
            e._flight_noted = True


def default_directory():
    job = config.get("PARATRAIN_JOB_ID") or str(os.getpid())
    return os.path.join(tempfile.gettempdir(), f"paratrain-flight-{job}")


def install(rank, world_size):
    """Turn the recorder on for this process (pt.init), with SIGUSR1 and an uncaught
    exception dumping it. Returns the recorder, or None when PARATRAIN_FLIGHT_RECORDER=0."""
    global RING
    size = config.get("PARATRAIN_FLIGHT_RECORDER")
    if not size:
        RING = None
        return None
    directory = config.get("PARATRAIN_FLIGHT_DIR") or default_directory()
    RING = FlightRecorder(size, rank, world_size, directory)
    for g in list(GROUPS):   # the groups made before (the world, made just before this)
        if getattr(g, "_flight", None) is None:
            g._flight = GroupLog(size)
    _on_signal()
    _on_uncaught()
    return RING


def dump(reason):
    """Write the ring (and every thread's stack) to DIR/rank-<R>.json; returns its path.
    Once per reason, so a broken group that fails every later call writes once."""
    ring = RING
    if ring is None or reason in _dumped:
        return None
    _dumped.add(reason)
    frames = sys._current_frames()
    stacks = {t.name: "".join(traceback.format_stack(frames[t.ident]))
              for t in threading.enumerate() if t.ident in frames}
    data = {"rank": ring.rank, "world_size": ring.world_size, "pid": os.getpid(), "host": os.uname().nodename,
            "reason": reason, "time": time.time(), "size": ring.size, "records": ring.all_records(),
            "groups": group_progress(), "stacks": stacks}
    os.makedirs(ring.directory, exist_ok=True)
    path = os.path.join(ring.directory, f"rank-{ring.rank}.json")
    tmp = f"{path}.{os.getpid()}.{next(_dump_numbers)}.tmp"   # two threads may dump at once: each its own file
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    return path


def group_progress():
    """{group name: calls made} for this process's live groups: how far each got."""
    from .calls import group_name
    return {group_name(g): g.calls_made() for g in list(GROUPS) if not g.is_destroyed()}


def _on_signal():
    """SIGUSR1 dumps the ring, and the process goes on. Left alone where the script has its
    own handler. (Not SIGTERM: a Python handler runs only between bytecodes, so a rank
    stuck inside an engine's wait would no longer end when the launcher stops the job;
    the others' dumps are asked for through the store instead, ask_peers.)"""
    import signal
    if threading.current_thread() is not threading.main_thread():
        return

    def on_usr1(signum, frame):
        _dumped.discard("SIGUSR1")
        path = dump("SIGUSR1")
        print(f"paratrain: flight recorder written to {path}", file=sys.stderr, flush=True)

    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGUSR1, on_usr1)


def _on_uncaught():
    previous = sys.excepthook
    if getattr(previous, "_paratrain_flight", False):
        return

    def hook(kind, value, tb):
        if not issubclass(kind, (KeyboardInterrupt, SystemExit)):
            path = dump(f"uncaught {kind.__name__}: {str(value).splitlines()[0] if str(value) else ''}")
            if path:
                print(f"paratrain: flight recorder written to {path}", file=sys.stderr, flush=True)
                if ask_peers is not None:   # before this rank's exit has the launcher stop the others
                    ask_peers(value, wait=True)
        previous(kind, value, tb)
    hook._paratrain_flight = True
    sys.excepthook = hook
