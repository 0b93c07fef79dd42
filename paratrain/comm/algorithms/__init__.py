"""How each collective is built from sends, receives, reads and writes.

One file per algorithm, each behind the same functions
(``all_reduce(transport, buf, code, op)`` and friends, on flat numpy buffers),
so a new algorithm is a new file, not a new branch in a big ``if`` (as Gloo
keeps its algorithms). An algorithm uses only the transport's documented
send, recv, sendrecv and isend (comm/transport.py), never the group behind it,
so it runs unchanged on every backend. Costs are given in the alpha-beta
model: a message of n bytes costs alpha + n*beta; P is the world size.
"""
import numpy as np

TAG = 1 << 24  # the algorithms' own messages use tags from here up; users' tags stay below


def split_bounds(n, parts):
    """Boundaries of ``parts`` nearly equal segments of n elements (some may be empty)."""
    return [i * n // parts for i in range(parts + 1)]


def scratch(buf, n=None):
    """A private buffer like ``buf`` for receiving into."""
    return np.empty(buf.size if n is None else n, dtype=buf.dtype)
