"""Which receive a message on a shm channel belongs to: matching by tag, as MPI does.

A channel src->dst (group.py) is first in, first out, but receives name a tag,
and the next message in the channel may carry another one:

- the user posted two receives from the same peer on two threads (irecv with
  tags 1 and 2) and the message for the second arrives first;
- the peer sent tag 1 then tag 2, and this rank receives tag 2 first
  (torch.distributed and MPI allow both orders);
- a user's isend is still in the channel when a collective's algorithm (ring,
  tree, naive: tags from algorithms.TAG up) sends its own message behind it.

So whoever is reading the channel delivers each message to the oldest posted
receive with its tag, or keeps it aside until one is posted: MPI's posted-
and unexpected-message queues. The posted ones are comm/matching.py's, which
the mpi backend uses too; the unexpected ones are shm's own (MPI keeps its own
for the mpi backend). A kept message is copied as its chunks arrive, so the
memory it takes is what the peer actually sent, never a size read from a
header. In the common case, one receive waiting for the next message, nothing
is kept and the message streams into the receive's buffer as before.
"""
import collections
import threading

from ..matching import PostedReceive, PostedReceives


class ShmReceive(PostedReceive):
    """A posted receive on shm: where its bytes go (uint8 view) and the dtype it expects."""

    __slots__ = ("raw", "code")

    def __init__(self, src, tag, raw, code, future=None):
        super().__init__(src, tag, future)
        self.raw, self.code = raw, code


class Mailbox:
    """One incoming channel's matching state: its posted receives (comm/matching.py)
    and its unexpected messages.

    Two locks: ``lock`` guards the two queues together and is held only for a
    moment, so that posting a receive never waits; ``reading`` is held by the one
    thread reading the channel, for a whole message, which may mean waiting for
    the peer to send it. Invariant (kept under ``lock``): no tag has both a posted
    receive and a kept message, since whichever comes second takes the first."""

    def __init__(self, src):
        self.src = src
        self.lock = threading.Lock()
        self.reading = threading.Lock()
        self.posted = PostedReceives()
        self.unexpected = collections.deque()     # (tag, code, payload uint8 array), oldest first

    def post(self, req):
        """Post a receive; returns the kept message it takes instead, if one with its
        tag came first, for the caller to copy in."""
        with self.lock:
            for i, kept in enumerate(self.unexpected):
                if kept[0] == req.tag:
                    del self.unexpected[i]
                    return kept
            self.posted.post(req)
        return None

    def take_posted(self, tag):
        """The oldest posted receive with this tag, removed; or None."""
        with self.lock:
            return self.posted.take(self.src, tag)

    def keep(self, tag, code, payload):
        """A message read whole with no receive for it when it began: into the receive
        posted for its tag since, if any (returned, for the caller to copy in), else kept."""
        with self.lock:
            req = self.posted.take(self.src, tag)
            if req is None:
                self.unexpected.append((tag, code, payload))
        return req

    def withdraw(self, req):
        """A receive gives up (its deadline passed): no message may land in it later."""
        with self.lock:
            self.posted.withdraw(req)
