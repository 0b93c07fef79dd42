"""PostedReceives: the mpi backend's queue of receives that are posted but not yet matched.

Why the mpi backend keeps one itself: its receives do not post an MPI_Irecv
until they know the message's size (a matched probe, mpi_backend._receiver),
so MPI's own posted-receive queue does not hold them. Without this queue a
receive was probed only when its turn came on its peer's receive lane, so
``irecv(tag=1); irecv(tag=2)`` deadlocked against a peer that sends tag 2
first with a blocking send over the eager limit: MPI holds that send until
the receiver matches it, and the receiver was probing tag 1 only.

Here every posted receive is probed by whichever thread is waiting for any
of them, as an MPI library's progress engine advances every outstanding
request inside any call. The rule MPI sets (MPI 4.0, sec. 3.5, "order") is
kept: of the receives posted for one (source, tag), only the oldest is
probed, so two messages with one tag land in the receives in posting order;
receives for different tags, or from different peers, match in whatever
order their messages come.
"""
import threading

from .work import settle


class PostedReceive:
    """One receive: ``poll()`` advances it (probe, then test the receive) and
    returns True once the message is in the buffer; an error it raises is the
    receive's result, kept for its owner. ``future``, when an irecv's Work
    waits on it, is settled by whichever thread finishes the receive, so the
    Work is done then, not once its own lane job has had its turn."""

    __slots__ = ("src", "tag", "poll", "future", "finished", "error", "_busy")

    def __init__(self, src, tag, poll, future=None):
        self.src, self.tag, self.poll, self.future = src, tag, poll, future
        self.finished = False
        self.error = None
        self._busy = threading.Lock()   # one thread at a time advances a receive


class PostedReceives:
    def __init__(self):
        self._queue = []                # in posting order
        self._guard = threading.Lock()

    def post(self, src, tag, poll, future=None):
        entry = PostedReceive(src, tag, poll, future)
        with self._guard:
            self._queue.append(entry)
        return entry

    def withdraw(self, entry):
        """Take a receive out unmatched (its owner gave up on it at its timeout), so
        a later message is not matched to a receive nobody waits for."""
        with self._guard:
            if entry in self._queue:
                self._queue.remove(entry)

    def _eligible(self):
        """The oldest receive of each (source, tag): the only one a message may match."""
        seen, out = set(), []
        with self._guard:
            for e in self._queue:
                if (e.src, e.tag) not in seen:
                    seen.add((e.src, e.tag))
                    out.append(e)
        return out

    def progress(self):
        """Advance every eligible receive once (skipping one another thread is
        advancing); finished ones leave the queue."""
        for e in self._eligible():
            if not e._busy.acquire(blocking=False):
                continue
            try:
                if not e.finished:
                    try:
                        finished = e.poll()
                    except Exception as err:   # the receive's own failure: its owner raises it
                        e.error, finished = err, True
                    if finished and e.future is not None:
                        settle(e.future, e.error)
                    e.finished = finished
            finally:
                e._busy.release()
            if e.finished:
                self.withdraw(e)

    def done(self, entry):
        """For a wait loop: advance everything, then say whether ``entry`` is finished."""
        self.progress()
        return entry.finished
