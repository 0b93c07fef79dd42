"""The mpi backend's posted receives, advanced by whichever thread waits for one.

Why the mpi backend keeps them itself: its receives do not post an MPI_Irecv
until they know the message's size (a matched probe, mpi_backend._receiver),
so MPI's own posted-receive queue does not hold them. A receive probed only
when its turn comes on its peer's receive lane would deadlock
``irecv(tag=1); irecv(tag=2)`` against a peer that sends tag 2 first with a
blocking send over the eager limit: MPI holds that send until the receiver
matches it, while the receiver probes tag 1 only.

The queue and its order rule are comm/matching.py's, shared with shm: only
the oldest receive of each (source, tag) is probed. What is MPI's own here is
``progress``: every eligible receive is advanced by whichever thread is
waiting for any of them, as an MPI library's progress engine advances every
outstanding request inside any call.
"""
import threading

from .matching import PostedReceive, PostedReceives


class MpiReceive(PostedReceive):
    """A posted receive whose ``poll()`` advances it (probe, then test the receive)
    and returns True once the message is in the buffer; an error it raises is the
    receive's result, kept for its owner."""

    __slots__ = ("poll", "busy")

    def __init__(self, src, tag, poll, future=None):
        super().__init__(src, tag, future)
        self.poll = poll
        self.busy = threading.Lock()   # one thread at a time advances a receive


class MpiReceives(PostedReceives):
    def progress(self):
        """Advance every eligible receive once (skipping one another thread is
        advancing); finished ones leave the queue."""
        for e in self.eligible():
            if not e.busy.acquire(blocking=False):
                continue
            try:
                if not e.done:
                    try:
                        if e.poll():
                            e.finish()
                    except Exception as err:   # the receive's own failure: its owner raises it
                        e.finish(err)
            finally:
                e.busy.release()
            if e.done:
                self.withdraw(e)

    def done(self, entry):
        """For a wait loop: advance everything, then say whether ``entry`` is finished."""
        self.progress()
        return entry.done
