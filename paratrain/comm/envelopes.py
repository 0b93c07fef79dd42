"""PARATRAIN_DEBUG's check of point-to-point messages, on engines that cannot make it.

shm's frames carry every message's dtype and size (wire.py), so a receive that
does not fit its message is refused there always. The engines we run on do not
know as much: Gloo receives exactly the bytes that were posted and *aborts the
receiving process* when a message of another size arrives ("Received data size
doesn't match expected size"), and MPI knows only bytes, so four float32 land in
a receive of four int32 without a word (a wrong size it reports; mpi_backend
checks that always). Checking that on every message would cost a second
message per send (twice Gloo's latency), so, as for collectives, it is
PARATRAIN_DEBUG's job: with it set, on the torch, mpi and hierarchical backends
each send is preceded by an *envelope*, a wire.py header saying the dtype, the
byte count and the tag, sent on a tag of its own (ENVELOPE_TAG + tag), and each
receive takes the envelope before its message. A message that does not fit is
still received (into scratch, up to MAX_DRAIN_BYTES), so the sender is not left
hanging and the next message on the channel arrives whole, and the receive
fails with a MismatchError naming both sides. NCCL's NCCL_CHECK_POINTERS and
MPI's debug libraries (MPICH's --enable-error-checking) make the same trade:
checks that cost latency only when asked for.

Order. Receives with one tag from one peer must match its messages in the order
they were posted, and a receive must not wait behind another tag's (the rule
every backend keeps, tests/workers/p2p_matching.py). Envelopes are posted when the
receive is called, so they match in posting order; each message's own receive
is posted once its envelope is in, on a lane per (peer, tag), so receives of one
tag post their messages' receives in the same order, while other tags go on;
the lane is retired when it has nothing left to do (a program that uses a tag
per micro-batch would otherwise keep a thread per tag), so there is one thread
per (peer, tag) with receives pending, not one per tag ever used.

The message's own receive is posted like any irecv (the transport's), so
destroy() gives it up like the others (torch: EngineWork.give_up). A receive
still waiting for its envelope when the program ends gives up: nobody is left
to read it, and Python joins the lane's thread before the atexit hook that
destroys the groups (work.program_ending). A message over MAX_DRAIN_BYTES that
does not fit is left on the channel, where the next receive of that peer and
tag would match it (and Gloo abort the process), so that (peer, tag) is
closed: every later receive on it fails at once, saying why.

Every rank must set PARATRAIN_DEBUG alike: a receiver without it never takes the
envelope, and on torch the sender waits for it until the timeout (on MPI the
32-byte envelopes go out eagerly and wait unmatched, unnoticed).
"""
import time

import numpy as np

from . import wire
from .algorithms import TAG as INTERNAL_TAG
from .errors import CommError, FrameError, MismatchError, PeerError
from .ops import CODE_TORCH, NUMPY_CODE
from .work import Work, program_ending

ENVELOPE_TAG = 2 * INTERNAL_TAG   # above the user's tags and the algorithms' own
MAX_DRAIN_BYTES = 64 << 20       # a message that does not fit, up to this size, is received and dropped
EXIT_CHECK_SECONDS = 0.2         # how often a receive waiting for its envelope looks for the program's end
_BYTE = NUMPY_CODE[np.dtype(np.uint8)]


def _kind(nbytes, code):
    """'24 bytes (float32 x 6)'"""
    dtype = CODE_TORCH[code]
    return f"{nbytes} bytes ({str(dtype).replace('torch.', '')} x {nbytes // dtype.itemsize})"


def envelope(buf, code, tag):
    """The header sent ahead of buf: its dtype code, byte count and tag."""
    env = np.zeros(wire.HEADER_SIZE, np.uint8)
    wire.encode_header(env, 0, code=code, tag=tag, seq=0, total=buf.nbytes, index=0, length=0)
    return env


def read_envelope(env, tag, what):
    """(code, nbytes) from an envelope; FrameError if it is not one, or not for this tag."""
    code, sent_tag, _, total, _, _ = wire.decode_header(env.tobytes(), capacity=0, max_total=1 << 62)
    if sent_tag != tag:
        raise FrameError(f"{what}: the envelope of a message says tag {sent_tag}, not {tag}: "
                         "a corrupt message, or a peer of another paratrain version")
    return code, total


def _named(e, what):
    """An error of an envelope's send or receive, said in terms of the user's call
    (the engine's own words name the envelope's tag, ENVELOPE_TAG + tag)."""
    ranks = (e.ranks,) if isinstance(e, PeerError) else ()
    return type(e)(f"{what}, passing its envelope (PARATRAIN_DEBUG is set): {e}", *ranks)


class AllOf(Work):
    """The Work of an envelope's send and its message's, started together."""

    def __init__(self, envelope_work, message_work, what):
        self._works = (envelope_work, message_work)
        self.what = what

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        for i, w in enumerate(self._works):
            try:
                w.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except CommError as e:
                raise (_named(e, self.what) if i == 0 else e) from e
            except TimeoutError:   # said of the user's call, not of its envelope
                raise TimeoutError(f"{self.what} not finished after {timeout}s") from None
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def exception(self):
        if not any(w.exception() is not None for w in self._works) and not self.is_completed():
            return None
        try:
            self.wait()
        except Exception as e:
            return e
        return None

    def result(self, timeout=None):
        self.wait(timeout)


class Closed:
    """Why a (peer, tag) is closed, and the envelope receives that were posted on it
    before it closed. Those stay referenced as long as the group: an engine's receive
    cannot be withdrawn, and Gloo, its handle dropped, is left with a posted receive
    whose buffer is gone, into which the peer's next envelope then lands."""

    __slots__ = ("why", "left_posted")

    def __init__(self, why):
        self.why, self.left_posted = why, []


def post_send(transport, buf, code, dst, tag, what):
    """isend of the envelope, then of buf, both started now over the group's
    transport (comm/transport.py); one Work for the two."""
    first = transport.isend(envelope(buf, code, tag), _BYTE, dst, ENVELOPE_TAG + tag)
    return AllOf(first, transport.isend(buf, code, dst, tag), what)


def post_recv(transport, buf, code, src, tag, what, ranks, lanes, closed):
    """irecv of the envelope now; the message's own receive once the envelope is in,
    on the lane of (src, tag) of ``lanes`` (the group's work.Lanes); a message that
    does not fit is drained and refused. ranks: the group's global ranks, for naming
    the two sides; closed: the group's (src, tag) -> why, for a refused message too
    large to drain, which is still on the channel (a Closed)."""
    me, peer = ranks[transport.rank], ranks[src]
    if (src, tag) in closed:   # nothing is posted on a closed channel
        def refuse():
            raise MismatchError(f"rank {me}: {what}: {closed[src, tag].why}")
        return lanes.submit(f"checked-recv-{src}-{tag}", refuse, what, reap=True)
    env = np.zeros(wire.HEADER_SIZE, np.uint8)
    first = transport.irecv(env, _BYTE, src, ENVELOPE_TAG + tag)

    def receive():
        if (src, tag) in closed:   # closed by a receive posted before this one
            closed[src, tag].left_posted.append(first)
            raise MismatchError(f"rank {me}: {what}: {closed[src, tag].why}")
        _wait_for_envelope(first, what)
        sent_code, nbytes = read_envelope(env, tag, what)
        if (sent_code, nbytes) == (code, buf.nbytes):
            transport.irecv(buf, code, src, tag).wait()
            return
        differs = "size" if nbytes != buf.nbytes else "dtype"
        error = (f"rank {me}: {what}: rank {peer} sent {_kind(nbytes, sent_code)} but the receive buffer holds "
                 f"{_kind(buf.nbytes, code)}: the two ranks disagree on the message's {differs} (checked because "
                 "PARATRAIN_DEBUG is set)")
        if nbytes <= max(buf.nbytes, MAX_DRAIN_BYTES):
            transport.irecv(np.empty(nbytes, np.uint8), _BYTE, src, tag).wait()
        else:
            closed[src, tag] = Closed(
                f"an earlier message of {nbytes} bytes from rank {peer} with tag {tag} did not fit its receive and, "
                f"larger than {MAX_DRAIN_BYTES} bytes, was left undrained ahead of every later one: receives from "
                "that rank with that tag cannot go on")
            error += "; the message, too large to drain, is left on the channel, which is closed to later receives"
        raise MismatchError(error)
    return lanes.submit(f"checked-recv-{src}-{tag}", receive, what, reap=True)


def _wait_for_envelope(first, what):
    """Wait for the envelope; fails at once if the group is destroyed meanwhile
    (EngineWork.give_up on torch), and gives up once the program is ending
    (nobody is left to read the receive, and the exit waits for this thread)."""
    while True:
        try:
            first.wait(EXIT_CHECK_SECONDS)
            return
        except TimeoutError:
            if program_ending.is_set():
                raise CommError(f"{what}: the program ended with this receive still waiting") from None
        except CommError as e:
            raise _named(e, what) from e
