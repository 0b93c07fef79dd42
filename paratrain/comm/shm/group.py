"""ShmGroup: the ProcessGroup of ranks on one host, over one shared-memory segment.

Layout of the segment (all offsets 64-byte aligned):

    meta      int64[8]        magic, world size, slot bytes, chunk bytes
    pids      int64[P]        each rank's pid: how a waiting rank notices a dead peer
    arrived   int64[P]        barriers each rank has entered: names who is behind
    desc      int64[2][P][8]  what each rank is calling (double-buffered by call parity)
    bar_sems  sem_t[P]        rank r's barrier semaphore; every other rank posts to it
    p2p_sems  sem_t[P][P][2]  channel src->dst: "full" and "empty" counts
    slots     P x 3 x slot_bytes   each rank's collective buffers, used round-robin by round
    frames    P x P x 2 x (32 + chunk_bytes)  point-to-point channels, two frames each

Collectives are built from rounds of "write my slot, barrier, read anyone's slot"
(see comm/shm/direct.py). The rule that makes it safe: a rank reads a
round's buffers only before it arrives at the barrier of the next round, and
writes a buffer only after every read of its previous use is over. With three
buffers per rank used in turn, a pipelined all-reduce needs one barrier per
round (direct.py shows the schedule), and simpler collectives one as well.

Point-to-point messages stream through a channel's two frames, each a fixed
header (comm/wire.py) and up to chunk_bytes of payload: the receiver copies
frame k while the sender fills frame k+1.
"""
import concurrent.futures
import ctypes
import os
import threading
import time
from datetime import timedelta

import numpy as np

from ... import config
from .. import ops
from ..algorithms import naive
from ..errors import FrameError, MismatchError, peer_died, timed_out
from ..group import ProcessGroup, check_descriptors, describe
from ..liveness import alive as _alive
from ..spin import for_this_thread, spin_seconds
from ..wire import HEADER_SIZE, decode_header, encode_header
from ..work import done_work, posted_work
from . import cma, direct, resident, segment
from .matching import Mailbox, ShmReceive
from .rounds import Rounds
from .semaphore import SEM_STRIDE, Semaphore
from .shared import SharedBuffers

MAGIC = 0x7061726174726E31  # "paratrn1"
MAX_MESSAGE = 1 << 40
NBUF = 3  # collective buffers per rank


def _align(n, a=64):
    return (n + a - 1) // a * a


class Layout:
    """Byte offsets of every region, computed the same way on every rank."""

    def __init__(self, P, slot_bytes, chunk_bytes):
        self.P, self.slot_bytes, self.chunk_bytes = P, slot_bytes, chunk_bytes
        off = 64
        self.pids = off
        off += _align(8 * P)
        self.arrived = off
        off += _align(8 * P)
        self.desc = off
        off += _align(2 * P * 8 * 8)
        self.bar_sems = off
        off += SEM_STRIDE * P
        self.p2p_sems = off
        off += SEM_STRIDE * P * P * 2
        self.slots = off = _align(off, 4096)
        off += P * NBUF * slot_bytes
        self.frame_bytes = _align(HEADER_SIZE + chunk_bytes)
        self.frames = off
        off += P * P * 2 * self.frame_bytes
        self.size = off


class ShmGroup(ProcessGroup):
    """Ranks on one host, talking through shared memory with blocking semaphores."""

    backend = "shm"
    receives_posted_when_called = True
    messages_carry_dtype = True   # frames say dtype and size: a receive that does not fit is refused always
    native_algorithms = ("direct",)

    def __init__(self, store, key, rank, ranks, timeout=None, slot_bytes=None, chunk_bytes=None):
        super().__init__(rank, len(ranks), ranks, timeout)
        P = self.world_size
        slot_bytes = slot_bytes or config.get("PARATRAIN_SHM_SLOT_BYTES")
        chunk_bytes = chunk_bytes or config.get("PARATRAIN_SHM_CHUNK_BYTES")
        self.layout = L = Layout(P, _align(slot_bytes), _align(chunk_bytes))
        self.slot_bytes, self.chunk_bytes = L.slot_bytes, L.chunk_bytes
        self.spin_s = spin_seconds(P, "PARATRAIN_SHM_SPIN_US")   # every rank of the group is on this host
        self._store, self._key = store, key
        header = [MAGIC, P, L.slot_bytes, L.chunk_bytes]

        def prepare(mm):  # rank 0, before anyone else can see the segment
            self._mm = mm
            self._map()
            self._meta[:4] = header
            for s in self._bar_sems:
                s.init(0)
            for i, s in enumerate(self._p2p_sem_list):
                s.init(0 if i % 2 == 0 else 2)  # full starts empty, empty starts at two free frames

        self._mm = segment.open_shared(store, key, rank, ranks, L.size, timedelta(seconds=self.timeout), prepare)
        self._map()
        if list(self._meta[:4]) != header:
            raise FrameError(f"shared-memory segment of group {key} has header {list(self._meta[:4])}, expected "
                             f"{header}: ranks disagree on PARATRAIN_SHM_* settings or paratrain versions")
        self._pids[rank] = os.getpid()
        self._shared = SharedBuffers(store, key, rank, self.ranks, self.timeout)
        self._epoch = 0
        self._round = 0
        self._send_seq = [0] * P
        self._recv_seq = [0] * P
        self._send_frame = [0] * P
        self._recv_frame = [0] * P
        self._send_locks = [threading.Lock() for _ in range(P)]
        self._boxes = [Mailbox(q) for q in range(P)]   # incoming channels: matching by tag
        self._need_check = False
        self._current = None
        self._cma_ok = None   # can every rank read its peers' memory (cma.usable)? Asked once, on first need
        # What the shared-memory algorithms may use of this group, and all they may use.
        self.rounds = Rounds(rank, P, self.ranks, self.slot_bytes, self._pids, self._sync, self._next_slots,
                             self._next_words)
        self._barrier_raw(lambda: "group set-up")

    # ---- mapping ------------------------------------------------------------------

    def _map(self):
        L, P, mm = self.layout, self.world_size, self._mm
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        raw = np.frombuffer(mm, dtype=np.uint8)
        self._raw = raw
        self._meta = raw[:64].view(np.int64)
        self._pids = raw[L.pids:L.pids + 8 * P].view(np.int64)
        self._arrived = raw[L.arrived:L.arrived + 8 * P].view(np.int64)
        self._desc = raw[L.desc:L.desc + 2 * P * 64].view(np.int64).reshape(2, P, 8)
        def sem(off):
            return Semaphore(self._base + off, raw[off:off + 4].view(np.uint32))
        self._bar_sems = [sem(L.bar_sems + SEM_STRIDE * r) for r in range(P)]
        self._p2p_sem_list = [sem(L.p2p_sems + SEM_STRIDE * i) for i in range(P * P * 2)]
        # slots[buffer][rank] -> uint8 view of slot_bytes
        sb = L.slot_bytes
        self._slots = [[raw[L.slots + (NBUF * r + b) * sb:L.slots + (NBUF * r + b + 1) * sb]
                        for r in range(P)] for b in range(NBUF)]
        self._words = [[s.view(np.int64) for s in slots] for slots in self._slots]
        fb = L.frame_bytes
        self._frames = [[[raw[L.frames + ((s * P + d) * 2 + k) * fb:L.frames + ((s * P + d) * 2 + k + 1) * fb]
                          for k in range(2)] for d in range(P)] for s in range(P)]

    def _full(self, src, dst):
        return self._p2p_sem_list[(src * self.world_size + dst) * 2]

    def _empty(self, src, dst):
        return self._p2p_sem_list[(src * self.world_size + dst) * 2 + 1]

    # ---- waiting, with a dead peer or a deadline turned into an error ------------

    def _spin(self):
        """How long a wait may spin before it sleeps, on this thread (spin.py)."""
        return for_this_thread(self.spin_s)

    def _what(self):
        return describe(self._current) if self._current is not None else "collective"

    def _watch(self, peers_fn, what, deadline, one_peer=False):
        """on_slice callback for Semaphore.acquire: raise if a peer we wait for died or time ran out.
        ``what`` may be a callable, so that describing the operation costs nothing until it fails;
        one_peer: a point-to-point wait (errors.timed_out)."""
        def on_slice():
            nonlocal what
            if callable(what):
                what = what()
            self._check_alive(what)   # pt.destroy() on another thread ends the wait
            peers = peers_fn()
            me = self.ranks[self.rank]
            dead = [(self.ranks[q], int(self._pids[q])) for q in peers if not _alive(int(self._pids[q]))]
            if dead:
                raise peer_died(dead, me, what)
            if time.time() >= deadline:
                unset = [self.ranks[q] for q in peers if int(self._pids[q]) <= 0]
                if unset:   # no pid: it never got through the group's set-up, so nothing to say it is alive
                    raise timed_out(me, self.timeout, what, unset, hint=(
                        "They never finished setting up this group: they failed or exited during pt.init() "
                        "or new_group() (their own output says why), or are stuck there"))
                last = {self.ranks[q]: describe(self._desc[:, q][np.argmax(self._desc[:, q, 0])])
                        for q in peers}
                raise timed_out(me, self.timeout, what, [self.ranks[q] for q in peers],
                                f"alive, but not there; {'its last call' if one_peer else 'their last calls'}: {last}",
                                one_peer)
        return on_slice

    def _barrier_raw(self, what):
        """All-to-all barrier on counting semaphores: each rank posts to every other's
        semaphore, then takes P-1 units from its own. Tokens from a rank already in
        the next barrier are safe: that rank could only get there after everyone
        arrived here, so a rank never passes while someone has not arrived.

        When every peer arrives within the spin, nothing else is built: the watcher
        that turns a dead peer or the deadline into an error is made only for a
        wait that goes on to sleep, since building it shows in a small all_reduce."""
        P, me = self.world_size, self.rank
        if P == 1:
            return
        self._epoch += 1
        epoch = self._epoch
        self._arrived[me] = epoch
        for q in range(P):
            if q != me:
                self._bar_sems[q].post()
        sem = self._bar_sems[me]
        spin, missing = self._spin(), P - 1
        while missing and sem.spin_acquire(spin):
            missing -= 1
        if missing:   # a peer is late: sleep in slices, watching for its death and the deadline
            deadline = time.time() + self.timeout
            on_slice = self._watch(lambda: [q for q in range(P) if self._arrived[q] < epoch], what, deadline)
            for _ in range(missing):
                sem.acquire(0.0, deadline, on_slice)

    # ---- the round structure the direct algorithms use ----------------------------

    def _checked(self, desc, fn, *args):
        """Always-on, cheap check: each rank publishes its descriptor; the first
        barrier of the collective (in _sync) compares all of them."""
        self._current = desc
        self._desc[desc[0] & 1, self.rank] = desc
        self._need_check = True
        try:
            fn(*args)
        finally:
            self._need_check = False

    def _next_slots(self):
        """This round's slot of every rank (uint8 views); the buffers are used in turn."""
        slots = self._slots[self._round % NBUF]
        self._round += 1
        return slots

    def _next_words(self):
        """This round's slot of every rank as int64 words, for the algorithms that only
        publish addresses and lengths there (cma.py); views made once, at mapping."""
        words = self._words[self._round % NBUF]
        self._round += 1
        return words

    def _sync(self):
        self._barrier_raw(self._what)
        if self._need_check:
            self._need_check = False
            rows = self._desc[self._current[0] & 1]
            sigs = rows[:, 7].tolist()
            if sigs.count(sigs[0]) != len(sigs):
                check_descriptors(rows, self._what, self.ranks)

    # ---- point to point -----------------------------------------------------------

    def _chunks(self, nbytes):
        """Frames a message of nbytes takes: one at least (an empty message is a header)."""
        return max(1, -(-nbytes // self.chunk_bytes))

    def _send(self, buf, code, dst, tag):
        with self._send_locks[dst]:
            self._write_frames(buf.view(np.uint8), code, dst, tag)

    def _fits_free_frames(self, nbytes, dst):
        """Whether a message of nbytes to dst would find every frame it needs free now."""
        return self._chunks(nbytes) <= self._empty(self.rank, dst).value()

    def _write_frames(self, raw, code, dst, tag):
        """A message's chunks into the channel to dst, each frame as it frees; the caller
        holds the channel's send lock."""
        total, cap = raw.size, self.chunk_bytes
        what = f"send of {total} bytes to rank {self.ranks[dst]} (tag {tag})"
        full, empty = self._full(self.rank, dst), self._empty(self.rank, dst)
        frames = self._frames[self.rank][dst]
        seq = self._send_seq[dst]
        self._send_seq[dst] += 1
        for i in range(self._chunks(total)):
            part = raw[i * cap:(i + 1) * cap]
            deadline = time.time() + self.timeout
            empty.acquire(self._spin(), deadline, self._watch(lambda: [dst], what, deadline, True))
            frame = frames[self._send_frame[dst]]
            self._send_frame[dst] ^= 1
            encode_header(frame, 0, code=code, tag=tag, seq=seq, total=total, index=i, length=part.size)
            ops.copy(frame[HEADER_SIZE:HEADER_SIZE + part.size], part)
            full.post()

    def _post_send(self, buf, code, dst, tag):
        """An isend that fits the channel's free frames, with nothing of ours queued before
        it to that peer, is copied in here and now, its Work done: no helper thread.

        Why: on the send lane the copy waits for this process's GIL, and a caller that
        goes straight on computing (a pipeline stage, its activations sent, starts its
        next forward) holds it for up to the interpreter's switch interval at a time,
        so its peer waits for the message. Two stages passing gpt's 128 KiB bundle while
        each computes 2-5 ms: 0.19-0.37 ms a hop copied in here, 0.35-0.66 on the lane
        (benchmarks/pipeline_hop.py). A larger message, or one behind others still going,
        takes the lane as before: waiting here for the receiver to free a frame could
        deadlock with it."""
        lock = self._send_locks[dst]
        if self._lanes.idle(f"send-{dst}") and lock.acquire(blocking=False):
            try:
                if self._fits_free_frames(buf.nbytes, dst):
                    self._write_frames(buf.view(np.uint8), code, dst, tag)
                    return done_work(self._p2p_what("isend", buf, "to", dst, tag))
            finally:
                lock.release()
        return super()._post_send(buf, code, dst, tag)

    # Receives are posted when called (matching.py), so an irecv's message is matched
    # as soon as any thread of this rank reads it off the channel: the irecv's own
    # lane job, another irecv's, or a blocking recv. Its Work is done then, not when
    # its lane job's turn comes behind the receives posted before it from that peer.

    def _posted(self, buf, code, src, tag, future=None):
        """A receive posted now: it takes a kept message with its tag at once, or
        waits in the peer's mailbox for whichever thread reads its message."""
        req = ShmReceive(src, tag, buf.view(np.uint8), code, future)
        kept = self._boxes[src].post(req)
        if kept is not None:
            self._land(req, src, kept[1], kept[2].size, kept[2])
        return req

    def _recv(self, buf, code, src, tag):
        """Receive the oldest message from src with this tag."""
        req = self._posted(buf, code, src, tag)
        self._advance(req, src)
        if req.error is not None:
            raise req.error

    def _post_recv(self, buf, code, src, tag):
        what = self._p2p_what("irecv", buf, "from", src, tag)
        req = self._posted(buf, code, src, tag, concurrent.futures.Future())
        deadline = time.time() + self.timeout   # from posting, not from its lane job's turn
        return posted_work(self._lanes, f"recv-{src}", req.future,
                           lambda: self._advance(req, src, deadline), what)

    def _advance(self, req, src, deadline=None):
        """Read src's channel until req is done, or raise at the deadline (default: the
        timeout from now). The thread holding the channel's ``reading`` lock reads
        whole messages and hands each to its receive; a receive on another thread
        meanwhile waits for its own to be handed over, or for the lock, to read the
        next one itself."""
        box = self._boxes[src]
        deadline = time.time() + self.timeout if deadline is None else deadline
        while not req.done:
            if box.reading.acquire(timeout=0.002):
                try:
                    if not req.done:
                        self._read_message(src, box, req, deadline)
                except BaseException:
                    box.withdraw(req)
                    raise
                finally:
                    box.reading.release()
            elif self._destroyed or time.time() > deadline:
                box.withdraw(req)
                if not req.done:
                    self._check_alive(f"recv from rank {self.ranks[src]} (tag {req.tag})")
                    raise timed_out(self.ranks[self.rank], self.timeout,
                                    f"recv of {req.raw.size} bytes from rank {self.ranks[src]} (tag {req.tag})",
                                    [self.ranks[src]], "while another thread of this rank read the channel",
                                    one_peer=True)

    def _land(self, req, src, rcode, rtotal, payload=None):
        """End req with a MismatchError if the message does not fit it; else copy a
        kept payload in (and end it). Returns True if the message fits."""
        if (rtotal, rcode) != (req.raw.size, req.code):
            req.finish(MismatchError(
                f"rank {self.ranks[src]} sent {rtotal} bytes of {ops.CODE_TORCH[rcode]} with tag {req.tag}, "
                f"but rank {self.ranks[self.rank]} is receiving {req.raw.size} bytes of "
                f"{ops.CODE_TORCH[req.code]} with tag {req.tag}: sends and receives must match in size, "
                "dtype and tag"))
            return False
        if payload is not None:
            ops.copy(req.raw, payload)
            req.finish()
        return True

    def _read_message(self, src, box, waiting, deadline):
        """Read the next whole message from src's channel (holding box.reading) and deliver
        it: into the oldest posted receive with its tag, or kept aside. A message that
        does not fit its receive is read to the end all the same (the receive fails),
        so the channel stays in step for the next one. ``waiting``'s deadline bounds
        the wait for the first chunk; each later chunk gets the full timeout."""
        me, cap = self.rank, self.chunk_bytes
        full, empty = self._full(src, me), self._empty(src, me)
        frames = self._frames[src][me]
        what = lambda: f"recv of {waiting.raw.size} bytes from rank {self.ranks[src]} (tag {waiting.tag})"  # noqa: E731
        seq = self._recv_seq[src] & 0xFFFFFFFF
        self._recv_seq[src] += 1
        chunks, i, into, kept = 1, 0, None, None
        try:
            while i < chunks:
                full.acquire(self._spin(), deadline, self._watch(lambda: [src], what, deadline, True))
                frame = frames[self._recv_frame[src]]
                self._recv_frame[src] ^= 1
                rcode, rtag, rseq, rtotal, index, length = decode_header(
                    frame[:HEADER_SIZE].tobytes(), capacity=cap, max_total=MAX_MESSAGE)
                if i == 0:
                    first = (rtotal, rtag, rcode)
                    chunks = self._chunks(rtotal)
                    req = box.take_posted(rtag)
                    if req is None:
                        kept = []
                    elif self._land(req, src, rcode, rtotal):
                        into = req
                if (rseq != seq or index != i or (rtotal, rtag, rcode) != first
                        or length != min(cap, rtotal - i * cap)):
                    raise FrameError(f"out-of-order frame from rank {self.ranks[src]}: message {rseq} chunk "
                                     f"{index} ({length} bytes), expected message {seq} chunk {i}")
                payload = frame[HEADER_SIZE:HEADER_SIZE + length]
                if into is not None:
                    ops.copy(into.raw[i * cap:i * cap + length], payload)
                elif kept is not None:
                    kept.append(payload.copy())
                empty.post()
                i += 1
                deadline = time.time() + self.timeout
        except Exception as e:   # the receive being filled, maybe another thread's, ends with it
            if into is not None:
                into.finish(e)
            raise
        if into is not None:
            into.finish()
        elif kept is not None:
            payload = np.concatenate(kept)
            late = box.keep(first[1], first[2], payload)   # a receive posted while it was read
            if late is not None:
                self._land(late, src, first[2], first[0], payload)

    def _sendrecv(self, send_buf, dst, recv_buf, src, code, tag):
        # A message that fits the channel's free frames is sent without waiting: no
        # helper thread needed. Inside an algorithm step both frames are free, unless a
        # user's message to dst is still there (or being sent): then the send may wait,
        # and must not keep this thread from receiving (the peer may need our receive
        # to free its own channel), so it goes on the send lane.
        if self._fits_free_frames(send_buf.nbytes, dst) and not self._send_locks[dst].locked():
            self._send(send_buf, code, dst, tag)
            self._recv(recv_buf, code, src, tag)
        else:
            super()._sendrecv(send_buf, dst, recv_buf, src, code, tag)

    # ---- collectives --------------------------------------------------------------

    def default_algorithm(self, nbytes):
        return "direct"

    def empty_shared(self, numel, dtype=None):
        self._check_alive("empty_shared")
        import torch
        return self._shared.allocate(numel, dtype or torch.float32)

    def _placement(self, buf):
        return self._shared.placement(buf)

    def _gather_placement(self, out, buf):
        """An all_gather in place (the input is this rank's own piece of the output, as
        ZeRO gathers its shards) puts each rank's input at a different offset of its
        part of a shared allocation, while resident.all_gather reads every peer's input
        at the offset of its own. Such a call is described, on every rank alike, as
        private, and takes the private path (cma or direct), which handles it in place."""
        placement = self._placement(buf)
        if placement and ops.address(out[self.rank]) == ops.address(buf):
            return 0
        return placement

    def _resident(self):
        """Where the current collective's buffer lives in shared memory, from its
        descriptor (every rank's agrees, or the first barrier raises); None: private."""
        return self._shared.decode(int(self._current[6]))

    def _cma_usable(self):
        """Single copy (cma.py) where the kernel lets every rank read its peers: probed
        once, by every rank at the same point of the same collective, and kept."""
        if self._cma_ok is None:
            self._cma_ok = cma.usable(self.rounds)
        return self._cma_ok

    def _all_reduce_with(self, algo, buf, code, op):
        R = self.rounds
        if algo is None:
            loc = self._resident()
            if loc is None and buf.nbytes >= cma.MIN_ALL_REDUCE_BYTES and self.world_size > 1 \
                    and self._cma_usable():
                cma.all_reduce(R, buf, code, op)   # the reduced slices fetched from their owners' buffers
            elif loc is None or direct.takes_small_path(R, buf):
                direct.all_reduce(R, buf, code, op)
            else:
                resident.all_reduce(R, *loc, buf, code, op)
        else:
            self._sync()  # the always-on check, before the point-to-point algorithm starts
            algo.all_reduce(self.transport, buf, code, op)

    def _barrier(self):
        self._sync()

    def _broadcast(self, buf, code, src):
        direct.broadcast(self.rounds, buf, code, src)

    def _reduce(self, buf, code, op, dst):
        direct.all_reduce(self.rounds, buf, code, op, dst=dst)

    def _all_gather_into(self, out, buf, code):
        loc = self._resident()
        if loc is not None:
            resident.all_gather(self.rounds, *loc, out, buf)
        elif buf.nbytes >= cma.MIN_BYTES and self.world_size > 1 and self._cma_usable():
            cma.all_gather(self.rounds, out, buf)   # one copy from each peer's private memory
        else:
            direct.all_gather(self.rounds, out, buf, code)

    def _reduce_scatter(self, out, inp, code, op):
        loc = self._resident()
        if loc is None:
            direct.reduce_scatter(self.rounds, out, inp, code, op)
        else:
            resident.reduce_scatter(self.rounds, *loc, out, inp, code, op)

    def _gather(self, out, buf, code, dst):
        direct.gather(self.rounds, out, buf, code, dst)

    def _scatter(self, buf, inp, code, src):
        direct.scatter(self.rounds, buf, inp, code, src)

    def _all_to_all(self, out, inp, code, even):
        if even:
            direct.all_to_all(self.rounds, out, inp, code)
        else:
            self._sync()
            naive.all_to_all(self.transport, out, inp, code)
