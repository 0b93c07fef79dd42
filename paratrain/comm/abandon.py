"""Giving up on a world whose member hangs on another host.

A peer that dies closes its sockets, and on this host its pid is gone: the
ranks waiting for it learn it at once (liveness.py). A peer on another host
that hangs (its machine stalled, its link cut) closes nothing: its peers would
wait for the collective's timeout, minutes (pytorch #123678). In an elastic
job the launcher declares such a worker dead when its heartbeat stops
(launch/elastic.py), and tells the others through the store; a rank that
hears it while the dead worker is in its world calls ``abandon(reason)``:

- every wait of paratrain's own engines (shm's slices, the checks at each
  call) raises ``PeerError(reason)`` from then on (``check``);
- Gloo waits inside C++ on its sockets, which no flag reaches. So the rank
  shuts down its own end of every TCP connection that is not to the
  launcher's store (``sever``): Gloo's pending reads and writes fail at once,
  and its error becomes the same PeerError.

The next ``pt.init()`` (the re-formed world) starts clean (``clear``).
"""
from .errors import PeerError
from .sockets import shut_down, socket_fds

_REASON = [None]


def abandon(reason, keep_port=None):
    """Give up on the current world: waits raise PeerError(reason), and this process's TCP
    connections other than those with ``keep_port`` at either end are shut down."""
    _REASON[0] = reason
    if keep_port is not None:
        sever(keep_port)


def reason():
    """Why this world was given up on, or None."""
    return _REASON[0]


def check():
    """Raise if this world was given up on (called in every wait's slice and at each call)."""
    if _REASON[0] is not None:
        raise PeerError(_REASON[0])


def clear():
    _REASON[0] = None


def sever(keep_port):
    """Shut down every TCP connection of this process that does not have ``keep_port``
    (the launcher's store) at either end; how many there were."""
    return shut_down(socket_fds(), lambda own, peer: keep_port not in (own, peer))
