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
and unexpected-message queues (MPI 4.0 standard, section 3.5, "Semantics of
Point-to-Point Communication": messages between one pair with one tag do not
overtake each other). A kept message is copied as its chunks arrive, so the
memory it takes is what the peer actually sent, never a size read from a
header. In the common case, one receive waiting for the next message, nothing
is kept and the message streams into the receive's buffer as before.
"""
import collections
import threading

from ..work import settle


class PostedReceive:
    """A receive waiting for its message: where the bytes go, and how it ended.
    ``future``, when an irecv's Work waits on it, is settled when it ends."""

    __slots__ = ("tag", "raw", "code", "done", "error", "future")

    def __init__(self, tag, raw, code, future=None):
        self.tag, self.raw, self.code, self.future = tag, raw, code, future
        self.done = False
        self.error = None

    def finish(self, error=None):
        self.error = error
        if self.future is not None:
            settle(self.future, error)
        self.done = True


class Mailbox:
    """One incoming channel's matching state.

    Two locks: ``lock`` guards the queues and is held only for a moment, so that
    posting a receive never waits; ``reading`` is held by the one thread reading
    the channel, for a whole message, which may mean waiting for the peer to send
    it. Invariant (kept under ``lock``): no tag has both a posted receive and a
    kept message, since whichever comes second takes the first."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reading = threading.Lock()
        self.posted = []                          # PostedReceive, oldest first
        self.unexpected = collections.deque()     # (tag, code, payload uint8 array), oldest first

    def post(self, req):
        """Post a receive (under ``lock``); returns the kept message it takes instead,
        if one with its tag came first, for the caller to copy in."""
        with self.lock:
            for i, kept in enumerate(self.unexpected):
                if kept[0] == req.tag:
                    del self.unexpected[i]
                    return kept
            self.posted.append(req)
        return None

    def _pop_posted(self, tag):
        for i, req in enumerate(self.posted):
            if req.tag == tag:
                del self.posted[i]
                return req
        return None

    def take_posted(self, tag):
        """The oldest posted receive with this tag, removed; or None."""
        with self.lock:
            return self._pop_posted(tag)

    def keep(self, tag, code, payload):
        """A message read whole with no receive for it when it began: into the receive
        posted for its tag since, if any (returned, for the caller to copy in), else kept."""
        with self.lock:
            req = self._pop_posted(tag)
            if req is None:
                self.unexpected.append((tag, code, payload))
        return req

    def withdraw(self, req):
        """A receive gives up (its deadline passed): no message may land in it later."""
        with self.lock:
            if req in self.posted:
                self.posted.remove(req)
