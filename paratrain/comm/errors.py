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
