"""Errors the communication layer raises.

Every error names what was being done and, where a peer is at fault, which
rank, so a user reading one line of a log knows where to look.
"""


def first_line(e):
    """The first line of an engine's error message (torch's and Gloo's run on with C++
    frames), or the error's class name when it has no message."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class CommError(RuntimeError):
    """Base class of every communication failure in paratrain."""


class PeerError(CommError):
    """A peer died or stopped answering while this rank waited for it."""

    def __init__(self, message, ranks=()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class CommTimeout(PeerError):
    """A wait ran past the group's timeout (``PARATRAIN_TIMEOUT`` seconds)."""


class MismatchError(CommError):
    """Ranks called different collectives, or the same one with different shapes or dtypes."""


class FrameError(CommError):
    """Bytes read from shared memory or a socket do not form a valid frame."""


# The two errors of a wait, built here for every backend (shm, torch, mpi), so they
# say the same things in the same words: who waited, in what, for whom, and why.

SAME_ORDER = "Ranks must call the same collectives in the same order"
SLOW = "raise PARATRAIN_TIMEOUT if {who} legitimately slow"


def peer_died(dead, me, what, why=None):
    """The PeerError of a wait whose peers are gone. dead: [(global rank, pid)];
    me: the waiting rank (global); what: the operation, as the user called it;
    why: the engine's own words, if it said something."""
    names = ", ".join(f"rank {r} (pid {pid})" for r, pid in dead)
    return PeerError(f"{names} died or exited while rank {me} waited for it in {what}{_said(why)}",
                     [r for r, _ in dead])


def timed_out(me, timeout, what, ranks, why=None, one_peer=False, hint=None):
    """The CommTimeout of a wait that ran past ``timeout`` seconds. ranks: the global
    ranks waited for. one_peer: a point-to-point wait (its peer did not answer),
    else a collective (whose ranks may have called something else: the hint says
    so, unless ``hint`` gives another)."""
    ranks = list(ranks)
    if one_peer:
        text = f"rank {me} timed out after {timeout:g}s in {what}: rank {', '.join(map(str, ranks))} did not answer"
        hint, sep = SLOW.format(who="it is") if hint is None else hint, "; "
    else:
        text = f"rank {me} timed out after {timeout:g}s in {what} waiting for ranks {ranks}"
        hint, sep = f"{SAME_ORDER}; {SLOW.format(who='a rank is')}" if hint is None else hint, ". "
    return CommTimeout(text + _said(why) + (sep + hint if hint else ""), ranks)


def _said(why):
    return f" ({why})" if why else ""

