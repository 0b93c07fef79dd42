"""What comm/ records of each call while a run is traced.

A collective is one span on its group's row, from the moment it starts
running (on the caller's thread, or on the group's collective lane for
``async_op=True``) to its end, with its op, group, sequence id, bytes and
algorithm, and what it is for where the caller said (``recorder.label``: a
ZeRO unit, a tensor-parallel layer, a gradient bucket). The sequence id is the group's own count of collectives, the
same on every rank, so the merge (chrome.py) finds each call on every rank
and splits it into *waiting for the last rank to arrive* and *moving the
bytes*.

A point-to-point message is matched the same way: the sender's n-th message
to a peer under a tag is the receiver's n-th from it under that tag (every
paratrain backend keeps MPI's non-overtaking order). A blocking send or
receive is one span; ``isend``/``irecv`` record their posting, and an
``irecv``'s ``wait()`` records the wait.
"""
import time

from . import recorder


def group_name(group):
    """A group's name in the trace: the one pt.init()/new_group gave it, else its ranks."""
    return getattr(group, "trace_name", None) or "ranks " + ",".join(map(str, group.ranks))


def collective(group, name, seq, nbytes, algorithm, fn, blocking=False):
    """``fn`` (the collective's body), recording its span when it runs. ``blocking``: the
    caller waits in it (not ``async_op``), so the analysis does not count its time as the
    caller's compute when it is called inside a forward or backward."""
    gname = group_name(group)
    args = {"op": name, "group": gname, "seq": seq, "bytes": nbytes, "ranks": list(group.ranks),
            "rank": group.ranks[group.rank]}
    if algorithm:
        args["algorithm"] = algorithm
    if blocking:
        args["blocking"] = True
    purpose = recorder.current_label()   # read on the caller's thread, before an async call leaves it
    if purpose:
        args["for"] = purpose
    track = f"comm {gname}"

    def run():
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            recorder.add(name, "comm", track, t0, time.perf_counter(), args)
    return run


def message_args(group, direction, peer, tag, nbytes):
    """The args of a point-to-point span: its match key (src, dst, tag, n) in global ranks."""
    me, other = group.ranks[group.rank], group.ranks[peer]
    src, dst = (me, other) if direction == "send" else (other, me)
    gname = group_name(group)
    n = recorder.next_message((gname, direction, other, tag))
    return {"group": gname, "src": src, "dst": dst, "tag": tag, "n": n, "bytes": nbytes, "rank": me}


def point_to_point(group, name, direction, peer, tag, nbytes, fn):
    """Run a blocking send or receive (``fn``), recording it; returns fn's result."""
    args = message_args(group, direction, peer, tag, nbytes)
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        recorder.add(name, "comm", f"comm {args['group']}", t0, time.perf_counter(), args)


def posted(group, name, direction, peer, tag, nbytes, post):
    """Post an isend or irecv (``post()`` returns its Work), recording the posting; an
    irecv's Work records its wait too."""
    args = message_args(group, direction, peer, tag, nbytes)
    t0 = time.perf_counter()
    work = post()
    recorder.add(name, "comm", f"comm {args['group']}", t0, time.perf_counter(), {**args, "posted": True})
    return _WaitRecorded(work, args) if direction == "recv" else work


class _WaitRecorded:
    """A receive's Work whose wait() is recorded as the receive (the others pass through)."""

    def __init__(self, work, args):
        self._work, self._args = work, args

    def wait(self, timeout=None):
        t0 = time.perf_counter()
        try:
            return self._work.wait(timeout)
        finally:
            recorder.add("recv", "comm", f"comm {self._args['group']}", t0, time.perf_counter(), self._args)

    def __getattr__(self, name):
        return getattr(self._work, name)
