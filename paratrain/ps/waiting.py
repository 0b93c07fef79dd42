"""Requests a server may not answer yet, each with the deadline it must be answered by.

A pull that would read weights staler than the consistency model allows, or a
registration that arrives before worker 0's initial values, is kept here with
its sender's identity and tried again after every request that can make it
ready (a push, a clock, a worker leaving). One that is still waiting when its
deadline passes is answered with an error instead (server.py names the
workers it waited for), so a dead worker is reported, not waited for forever.
A retried request that must wait again keeps its *first* deadline.
"""
import time


class Waiting:
    def __init__(self, timeout):
        self.timeout = timeout
        self.items = []   # [deadline, ident, header, meta, payload]

    def __len__(self):
        return len(self.items)

    def add(self, ident, h, meta, payload, deadline=None):
        """Keep a request; its payload is copied (ZeroMQ reuses the received frames)."""
        self.items.append([time.monotonic() + self.timeout if deadline is None else deadline,
                           ident, h, meta, bytes(payload)])

    def take(self):
        """Every waiting request, removed: the caller retries each, and adds back
        (with its deadline) those that must wait on."""
        items, self.items = self.items, []
        return items

    def keep_deadline(self, since, deadline):
        """The requests added since there were ``since`` (a retried one, waiting on)
        keep the deadline it first had."""
        for item in self.items[since:]:
            item[0] = deadline

    def expired(self):
        """The requests whose deadline has passed, removed."""
        now = time.monotonic()
        late = [d for d in self.items if d[0] <= now]
        if late:
            self.items = [d for d in self.items if d[0] > now]
        return late
