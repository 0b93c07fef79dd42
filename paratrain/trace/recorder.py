"""This process's recording: spans on one clock, streamed to its own file.

One recorder per process, made by ``start`` and stopped by ``stop`` (or at
exit). The hot paths ask ``recorder.ON`` first, so a run that is not traced
pays one attribute read and one branch per call. A span is a tuple appended
to a list; every ``FLUSH_EVERY`` spans the list is written out as JSON lines
to ``DIR/rank-<R>.jsonl`` (or ``server-<i>.jsonl``), so a long run's memory
stays bounded, as Horovod's timeline writer streams its records.

The file's first line is its header: who wrote it (role, rank, pid, host)
and its clock's offset to rank 0's, with the uncertainty of that estimate
(clock.py). Every later line is one span:
``[name, category, track, start_s, end_s, args]`` on this process's
``time.perf_counter`` clock, in seconds. Categories say what a span is for
the analysis (``step``, ``compute``, ``data``, ``comm``, ``checkpoint``,
``user``); tracks say which row it is drawn on (``compute``, ``data``,
``comm <group>``).
"""
import atexit
import json
import os
import threading
import time

FLUSH_EVERY = 4096

ON = False        # read by the hot paths before they call anything here
_REC = None       # the Recorder while ON
_CPU = False      # compute spans also note this thread's CPU time (one compute thread per process)


class Recorder:
    def __init__(self, path, header):
        self.path = path
        self._file = open(path, "w")
        self._file.write(json.dumps(header) + "\n")
        self._spans = []
        self._lock = threading.Lock()   # flush swaps the list; appends need no lock (the GIL)
        self.counts = {}                # point-to-point messages per (group, direction, peer, tag)

    def add(self, name, category, track, start, end, args=None):
        self._spans.append((name, category, track, start, end, args))
        if len(self._spans) >= FLUSH_EVERY:
            self.flush()

    def flush(self):
        with self._lock:
            spans, self._spans = self._spans, []
            if self._file is None:
                return
            self._file.write("".join(json.dumps(s) + "\n" for s in spans))
            self._file.flush()

    def close(self):
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.write('{"end": true}\n')   # chrome.END: the file is complete
                self._file.close()
                self._file = None


def start(directory, role, index, offset_s=0.0, uncertainty_s=None, count_cpu=False, **extra):
    """Record this process's spans into ``directory/<role>-<index>.jsonl`` from now on.
    ``offset_s``: what to add to this process's clock to read rank 0's. ``count_cpu``:
    compute spans note the CPU time their thread got (true only where one thread
    computes), which tells a slow rank from one that waited for a CPU."""
    global ON, _REC, _CPU
    stop()
    _CPU = bool(count_cpu)
    os.makedirs(directory, exist_ok=True)
    header = {"role": role, "index": int(index), "pid": os.getpid(), "host": os.uname().nodename,
              "offset_s": offset_s, "uncertainty_s": uncertainty_s, "clock": "time.perf_counter", **extra}
    _REC = Recorder(os.path.join(directory, f"{role}-{int(index)}.jsonl"), header)
    ON = True
    atexit.register(stop)


def stop():
    """Write out what is left and close the file. Safe to call twice."""
    global ON, _REC
    rec, _REC, ON = _REC, None, False
    if rec is not None:
        rec.close()


def pause(paused=True):
    """Stop recording (or go on) without closing the file: ``paratrain bench trace``
    times traced and untraced steps of one run, interleaved."""
    global ON
    ON = _REC is not None and not paused


def add(name, category, track, start_s, end_s, args=None):
    rec = _REC
    if rec is not None:
        rec.add(name, category, track, start_s, end_s, args)


def cpu_now():
    """This thread's CPU seconds, where compute spans count them (else None)."""
    return time.thread_time() if _CPU else None


def add_compute(name, start_s, cpu_start, args=None, track="compute"):
    """A compute span from ``start_s`` (and ``cpu_start``, cpu_now()'s) to now."""
    rec = _REC
    if rec is not None:
        if cpu_start is not None:
            args = {**(args or {}), "cpu_s": time.thread_time() - cpu_start}
        rec.add(name, "compute", track, start_s, time.perf_counter(), args)


def next_message(key):
    """The number of this point-to-point message among those with the same key
    (group, direction, peer, tag): the sender's n-th message is the receiver's n-th."""
    rec = _REC
    if rec is None:
        return 0
    n = rec.counts.get(key, 0)
    rec.counts[key] = n + 1
    return n


_LABELS = threading.local()
_UNSET = object()


def current_label():
    """What the collectives of this thread are for right now (``label``), or None."""
    return getattr(_LABELS, "name", None)


def set_label(name):
    """Set this thread's label (for hooks that open and close it apart; else ``label``)."""
    _LABELS.name = name


class label:
    """``with label("layers.3.mlp.fc1"):`` names what the collectives called inside are
    for (a ZeRO unit, a tensor-parallel layer, a gradient bucket): each one's span
    carries it as ``for``. Per thread; costs one branch when the run is not traced."""

    __slots__ = ("name", "prev")

    def __init__(self, name):
        self.name = name
        self.prev = _UNSET

    def __enter__(self):
        if ON:
            self.prev = getattr(_LABELS, "name", None)
            _LABELS.name = self.name
        return self

    def __exit__(self, *exc):
        if self.prev is not _UNSET:   # (entered while traced)
            _LABELS.name = self.prev
        return False


class span:
    """``with pt.trace.span("name"):`` records the block as one span on this rank's
    compute row (or ``track=``), under ``category`` (``user`` unless said). Costs one
    branch when the run is not traced. Usable as a decorator too."""

    __slots__ = ("name", "category", "track", "args", "t0", "c0")

    def __init__(self, name, category="user", track="compute", **args):
        self.name, self.category, self.track, self.args = str(name), category, track, args or None

    def __enter__(self):
        if ON:
            self.c0 = cpu_now() if self.category == "compute" else None
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if ON and hasattr(self, "t0"):
            if self.c0 is not None:
                add_compute(self.name, self.t0, self.c0, self.args, self.track)
            else:
                add(self.name, self.category, self.track, self.t0, time.perf_counter(), self.args)
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapped(*a, **kw):
            with span(self.name, self.category, self.track, **(self.args or {})):
                return fn(*a, **kw)
        return wrapped
