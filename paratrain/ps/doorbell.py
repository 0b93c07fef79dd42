"""Same-host doorbells: a worker's step reaches its server through a pipe, not ZeroMQ.

With the tensors already in shared memory (shared.py), what is left of a
same-host step is two small messages, and ZeroMQ makes each of them hop
through two I/O threads: the sender's thread wakes its I/O thread, which
writes to TCP, whose reader thread wakes the receiving thread. Through a pair
of named pipes (FIFOs) the write itself wakes the reader, so a small message's
round trip costs one wake-up a side instead of three.

So the requests a worker makes through a shared segment (``Client.step``:
push, clock and pull in one request, the hot path of dense training; and the
plain ``push`` and ``pull`` of every piece on a server) and their answers are
*rung* on FIFOs:

- the server makes one FIFO it reads (its *bell*) and one per worker it writes
  (the worker's *answer* FIFO), all in /dev/shm next to its segment, mode 0600;
- a worker rings with one 24-byte record (magic, worker, op, flags, clock,
  sequence number): pipes write up to PIPE_BUF bytes atomically, so records of
  several workers never interleave; the server answers with the 8-byte
  sequence number. Both ends poll the FIFOs beside their ZeroMQ sockets.

A worker's clocks are rung there too (never answered), so a clock sent
through ZeroMQ cannot be overtaken by the rung pull after it. Everything else
still goes through ZeroMQ: registration, errors (the server sends them to the
worker's ZeroMQ identity, as it would any error), embedding rows, every other
request, and a request after a server restart (the old server's bell has
no reader any more: the ring fails with EPIPE and the worker sends the step
over ZeroMQ, whose reply names the new segment and its bells). Bytes that
are not a record (wrong magic, a worker out of range) are skipped with a
warning up to the next valid record, so the records around them still count;
nothing in a record is more than numbers. Only processes of the same user can
open the FIFOs, as for the segment itself.
"""
import collections
import os
import struct

from ..comm.shm import segment

RECORD = struct.Struct("<HHBBxxqQ")   # magic, worker, op, flags, clock, sequence number
ANSWER = struct.Struct("<Q")       # the sequence number of the step answered
MAGIC = 0xB311
MAGIC_BYTES = struct.pack("<H", MAGIC)   # how a record starts on the wire
Rung = collections.namedtuple("Rung", "worker seq")   # the server's "identity" of a rung step: answer here


def _drain(fd):
    """Everything waiting in the non-blocking FIFO ``fd``, read to the end (a FIFO left
    readable would wake every poll)."""
    data = b""
    try:
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    return data


def names(base, workers):
    """The bell's name and each worker's answer FIFO's name, from the segment's name."""
    return base + "-bell", [f"{base}-w{w}" for w in range(workers)]


class ServerBells:
    """The server's ends: it reads its bell and writes every worker's answer FIFO.
    Opened read-write and non-blocking, so an open never waits for the other side
    and a worker that stopped reading can never block the server."""

    def __init__(self, base, workers):
        bell, answers = names(base, workers)
        self.paths = [segment.create_fifo(n) for n in (bell, *answers)]
        flags = os.O_RDWR | os.O_NONBLOCK
        self.fds = [os.open(p, flags) for p in self.paths]
        self.workers = workers
        self.partial = b""

    def fileno(self):
        return self.fds[0]

    def rung(self):
        """The records waiting on the bell: [(worker, op, flags, clock, seq)].

        Bytes that are not a record (junk some other process of this user wrote) are
        skipped up to the next place a valid record starts, so the workers' records
        around them still count: each of those is one atomic write, which junk cannot
        split, only precede or follow. A record cut short by the end of the read waits
        for the rest in ``partial``."""
        data = self.partial + _drain(self.fds[0])
        out, at, skipped = [], 0, 0
        while len(data) - at >= RECORD.size:
            magic, worker, op, flags, clock, seq = RECORD.unpack_from(data, at)
            if magic == MAGIC and worker < self.workers:
                out.append((worker, op, flags, clock, seq))
                at += RECORD.size
                continue
            nxt = data.find(MAGIC_BYTES, at + 1)
            nxt = len(data) - 1 if nxt < 0 else nxt   # (the last byte may be half a magic)
            skipped += nxt - at
            at = nxt
        if skipped:
            print(f"doorbell: skipped {skipped} bytes that were not a valid record (wrong magic or a worker "
                  f"out of range 0..{self.workers - 1}); the records around them were kept", flush=True)
        self.partial = data[at:]
        return out

    def answer(self, worker, seq):
        try:
            os.write(self.fds[1 + worker], ANSWER.pack(seq))
        except (BlockingIOError, BrokenPipeError):
            pass   # a worker that stopped reading: it will time out and ask again over ZeroMQ

    def unlink(self):
        """Remove the names (the pipes live on while opened): once every worker has them."""
        for p in self.paths:
            segment.unlink(p)
        self.paths = []

    def close(self):
        self.unlink()
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class WorkerBells:
    """A worker's ends for one server: it writes the bell and reads its answer FIFO."""

    def __init__(self, base, worker, workers):
        bell, answers = names(base, workers)
        self.worker = worker
        self.ring_fd = os.open(segment.path_of(bell), os.O_WRONLY | os.O_NONBLOCK)   # ENXIO without a reader
        try:
            self.answer_fd = os.open(segment.path_of(answers[worker]), os.O_RDWR | os.O_NONBLOCK)
        except OSError:
            os.close(self.ring_fd)
            raise

    def fileno(self):
        return self.answer_fd

    def ring(self, op, flags, clock, seq):
        """Raises OSError (EPIPE: the server is gone) when nobody reads the bell."""
        os.write(self.ring_fd, RECORD.pack(MAGIC, self.worker, op, flags, clock, seq))

    def answered(self):
        """The sequence numbers answered since the last call."""
        data = _drain(self.answer_fd)
        return [ANSWER.unpack_from(data, at)[0] for at in range(0, len(data) - len(data) % ANSWER.size,
                                                                ANSWER.size)]

    def close(self):
        for fd in (self.ring_fd, self.answer_fd):
            if fd is not None:
                os.close(fd)
        self.ring_fd = self.answer_fd = None


def open_worker(info, worker, workers):
    """The worker's bells for a server whose segment it mapped, or None (then ZeroMQ)."""
    if not info or not info.get("bells"):
        return None
    try:
        return WorkerBells(info["name"], worker, workers)
    except OSError:
        return None
