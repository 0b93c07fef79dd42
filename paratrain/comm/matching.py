"""Receives posted and not yet matched: one queue for the shm and mpi backends.

Both backends post a receive when it is called, as MPI posts an Irecv, and
match it to its message later, on whichever thread gets to it:

- shm (shm/matching.py): the thread reading a peer's channel hands each
  message to the oldest posted receive with its tag, or keeps it aside;
- mpi (mpi_receives.py): its receives post no MPI_Irecv until a matched probe
  gave the message's size, so MPI's own queue does not hold them; whichever
  thread waits for one probes them all, as MPI's progress engine advances
  every outstanding request inside any call.

The rule both keep is MPI's (MPI 4.0 standard, sec. 3.5, "Semantics of
Point-to-Point Communication"): messages from one source with one tag do not
overtake each other, so of the receives posted for one (source, tag) only the
oldest may take a message, and two messages with one tag land in the
receives in posting order; receives for different tags, or from different
peers, match in whatever order their messages come.
"""
import threading

from .work import settle


class PostedReceive:
    """One posted receive: from whom, with which tag, and how it ended.
    ``future``, when an irecv's Work waits on it, is settled when it ends, by
    whichever thread ends it, so the Work is done then, not once its own lane
    job has had its turn. A backend subclasses it with where the bytes go."""

    __slots__ = ("src", "tag", "future", "done", "error")

    def __init__(self, src, tag, future=None):
        self.src, self.tag, self.future = src, tag, future
        self.done = False
        self.error = None

    def finish(self, error=None):
        """End the receive, with its error if it failed (its owner raises it)."""
        self.error = error
        if self.future is not None:
            settle(self.future, error)
        self.done = True


class PostedReceives:
    """Posted receives in posting order. Its lock is held only for a moment, so
    posting a receive never waits for a message."""

    def __init__(self):
        self._queue = []
        self._lock = threading.Lock()

    def post(self, req):
        with self._lock:
            self._queue.append(req)
        return req

    def withdraw(self, req):
        """Take a receive out unmatched (its owner gave up on it, at its deadline), so
        that no later message lands in a receive nobody waits for."""
        with self._lock:
            if req in self._queue:
                self._queue.remove(req)

    def take(self, src, tag):
        """The oldest receive posted for (src, tag), taken out; None if there is none."""
        with self._lock:
            for i, req in enumerate(self._queue):
                if req.tag == tag and req.src == src:
                    del self._queue[i]
                    return req
        return None

    def eligible(self):
        """The oldest receive of each (source, tag): the only ones a message may match."""
        seen, out = set(), []
        with self._lock:
            for req in self._queue:
                if (req.src, req.tag) not in seen:
                    seen.add((req.src, req.tag))
                    out.append(req)
        return out
