"""What the MPI backend needs around mpi4py: datatypes, buffer spans, and waiting.

MPI's blocking calls cannot time out, so MpiGroup issues nonblocking ones and
completes them with ``poll``: a few Tests at once (a small message is often
already there), then testing for as long as the spin policy allows (spin.py),
then sleeps doubling from 20 us to 1 ms, until the deadline. Polling is also
what moves a nonblocking collective along: MPI progresses it only inside MPI
calls, so a waiting rank must keep calling Test rather than sleep to the end.
"""
import os
import time

import numpy as np

from . import ops

SPIN_TESTS = 32          # Test() calls at once: a small message is often there by then,
                         # then keep testing as long as spin.py's policy allows ...
SLEEP_FIRST = 20e-6      # ... then sleep, doubling from 20 us ...
SLEEP_MAX = 1e-3         # ... to 1 ms: worst added latency 1 ms, and an idle rank costs ~nothing


def mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError("backend='mpi' needs mpi4py and an MPI library: pip install paratrain[mpi] "
                          f"(importing mpi4py failed: {e})") from e
    return MPI


def datatype(MPI, code):
    """The MPI datatype a buffer of dtype ``code`` travels as (16-bit floats as raw uint16)."""
    return {1: MPI.UINT16_T, 2: MPI.UINT16_T, 3: MPI.FLOAT, 4: MPI.DOUBLE,
            5: MPI.INT32_T, 6: MPI.INT64_T, 7: MPI.UINT8_T}[code]


def same(a, b):
    return a.size == b.size and ops.address(a) == ops.address(b)


def sending(pieces):
    """The pieces as one buffer MPI can read: themselves if they lie end to end, else a copy."""
    span = ops.span(pieces)
    return np.concatenate(pieces) if span is None else span


def unpack(flat, pieces):
    off = 0
    for p in pieces:
        p[...] = flat[off:off + p.size]
        off += p.size


def local_ranks():
    """How many ranks of the job mpirun started on this host (Open MPI's or MPICH's word; 1 if neither says)."""
    return int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or os.environ.get("MPI_LOCALNRANKS") or "1")


def poll(done, timeout, on_timeout, spin_s=0.0):
    """Call done() until it returns True (see the module docstring); past ``timeout``
    seconds raise on_timeout(). MPI's nonblocking collectives advance only inside MPI
    calls, so the polling Tests are also what makes progress."""
    for _ in range(SPIN_TESTS):
        if done():
            return
    now = time.monotonic()
    spin_end, deadline = now + spin_s, now + timeout
    while time.monotonic() < spin_end:
        if done():
            return
    delay = SLEEP_FIRST
    while not done():
        if time.monotonic() >= deadline:
            raise on_timeout()
        time.sleep(delay)
        delay = min(2 * delay, SLEEP_MAX)
