"""MpiGroup: the ProcessGroup API over MPI (mpi4py), for jobs started by ``mpirun``.

``pt.init(backend="mpi")`` runs every collective on the MPI library's own
implementation (Open MPI's tuned/libnbc, MPICH's, a vendor's), the engine HPC
clusters already tune for their network; ``algorithm="ring"/"tree"/"naive"``
runs the portable algorithms of comm/algorithms/ over MPI point-to-point
instead, which is how the benchmark compares them on the same transport.

Three things MPI does not give us, and what we do about them:

- **No wait may last forever**, but MPI's blocking calls cannot time out. Every
  call is the nonblocking variant (Isend, Improbe + Imrecv, and the MPI-3
  nonblocking collectives Iallreduce, Ibarrier, ...), completed by polling: a few
  tries at once, since a small message is often already there, then testing for
  as long as the spin policy allows (spin.py), then sleeps doubling from 20 us
  to 1 ms, so a waiting rank leaves its core to the others (``mpirun
  --oversubscribe``). Past ``timeout`` seconds we raise CommTimeout. Polling is
  also what moves a nonblocking collective along: MPI progresses it only inside
  MPI calls, which is why a rank should not just sleep until the deadline.
- **No bfloat16 or float16 reductions.** MPI moves their bytes as 16-bit
  integers and torch reduces them: an all-to-all hands rank r every rank's
  segment r, rank r combines them in rank order, an all-gather returns the
  reduced segments (Rabenseifner's reduce-scatter + all-gather, Thakur et al.,
  IJHPCA 2005, sec. 4.4). Each element is reduced once, in one order, so every
  rank ends bit-identical:

      cost = 2 alpha_coll + 2 (P-1)/P n beta

- **Library hygiene.** The world group talks over a duplicate of COMM_WORLD
  (``MPI_Comm_idup``), so its messages never match a user's own mpi4py traffic.

Buffers go to MPI through the buffer protocol with explicit datatypes (the
uppercase mpi4py methods): nothing is pickled. Ranks are group-local, as in the
rest of paratrain; ``ranks`` maps them to global (COMM_WORLD) ranks.
"""
import concurrent.futures
import contextlib
import os
import threading
import time
import zlib

import numpy as np

from . import ops
from .algorithms import split_bounds
from .envelopes import MAX_DRAIN_BYTES   # a message that does not fit, up to this size, is received and dropped
from .errors import CommError, MismatchError, timed_out
from .group import COLL_CODE, ProcessGroup, describe, timeout_from_env
from .mpi_receives import MpiReceive, MpiReceives
from .mpi_support import datatype, local_ranks, mpi, poll, same, sending, unpack
from .spin import for_this_thread, spin_seconds
from .work import EngineWork, posted_work

_HALF = (1, 2)           # float16, bfloat16: MPI has no reduction for them


class MpiGroup(ProcessGroup):
    backend = "mpi"
    receives_posted_when_called = True
    native_algorithms = ("native",)
    # Pending receives and collectives on the lanes see the destroyed flag at their next
    # poll and raise CommError; the communicator is freed once they have stopped polling it.
    lane_stop_seconds = 2.0

    def __init__(self, comm, ranks, timeout=None):
        """comm: an mpi4py intracommunicator; ranks: the global rank of each of its members."""
        MPI = self._MPI = mpi()
        super().__init__(comm.Get_rank(), comm.Get_size(), ranks, timeout)
        if len(self.ranks) != self.world_size:
            raise ValueError(f"MpiGroup: {len(self.ranks)} global ranks given for a communicator of "
                             f"{self.world_size}")
        self.comm = comm
        self._tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767  # the attribute lives on COMM_WORLD only
        # Lanes call MPI from several threads; below THREAD_MULTIPLE, one call at a time.
        self._lock = (contextlib.nullcontext() if MPI.Query_thread() >= MPI.THREAD_MULTIPLE
                      else threading.Lock())
        self._spin_s = spin_seconds(local_ranks(), "PARATRAIN_MPI_SPIN_US")
        self._abandoned = []  # requests given up on: kept, with their buffers, in case MPI completes them
        self._posted = MpiReceives()
        self._current = self._agreeing = None

    def default_algorithm(self, nbytes):
        return "native"

    # ---- waiting ------------------------------------------------------------------

    def _me(self):
        return self.ranks[self.rank]

    def _what(self, name):
        if self._agreeing is not None:
            return f"the PARATRAIN_DEBUG check before {describe(self._agreeing)}"
        d = self._current
        return describe(d) if d is not None and d[1] == COLL_CODE[name] else name

    def _agree(self, desc):
        self._agreeing = desc  # so that a timeout names the call being checked, not the check
        try:
            super()._agree(desc)
        finally:
            self._agreeing = None

    def _call(self, what, start):
        """Start an MPI call (under the lock), turning MPI errors into ours."""
        MPI = self._MPI
        try:
            with self._lock:
                return start()
        except MPI.Exception as e:
            raise self._error(e, what) from e

    def _error(self, e, what):
        cls = MismatchError if e.Get_error_class() == self._MPI.ERR_TRUNCATE else CommError
        return cls(f"rank {self._me()}: MPI error in {what}: {e.Get_error_string()}")

    def _wait(self, done, what, peers=None, keep=list, deadline=None, request_only=False):
        """Poll done() or raise CommTimeout naming ``what`` and ``peers()``, the group-local
        ranks waited for (None: a collective, all the others). keep(): requests MPI cannot
        withdraw (a send, a collective), kept with their buffers if we give up on them.
        deadline: a time.monotonic() to give up at (default: the timeout from now).
        request_only: done() only tests a request, which MPI allows after the communicator
        is freed, so an operation that finished before the group was destroyed still
        reports success (a receive's probe would use the communicator)."""
        MPI = self._MPI

        def on_timeout():
            if peers is not None:
                return timed_out(self._me(), self.timeout, what, [self.ranks[q] for q in peers()], one_peer=True)
            others = [g for i, g in enumerate(self.ranks) if i != self.rank]
            return timed_out(self._me(), self.timeout, f"{what} over MPI", others, "MPI cannot say which are missing")
        def live():
            if self._destroyed:   # MPI would abort the job on a call on the freed communicator
                if request_only and done():
                    return True
                raise CommError(f"rank {self._me()}: {what} was still waiting when its group was destroyed "
                                "(pt.destroy() or group.destroy())")
            return done()
        finished = False
        timeout = self.timeout if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            poll(live, timeout, on_timeout, for_this_thread(self._spin_s))
            finished = True
        except MPI.Exception as e:
            raise self._error(e, what) from e
        finally:
            if not finished:  # timed out, refused a message, or interrupted
                self._abandoned.extend(keep())

    def _tester(self, req):
        def done():
            with self._lock:
                return req.Test()
        return done

    def _coll(self, name, start, what=None):
        what = what or self._what(name)
        req = self._call(what, start)
        self._wait(self._tester(req), what, keep=lambda: [req], request_only=True)

    # ---- point to point (group-local ranks) ------------------------------------------

    def _buf(self, buf, code):
        return [buf, datatype(self._MPI, code)]

    def _check_tag(self, tag):
        if not 0 <= tag <= self._tag_ub:
            raise ValueError(f"tag {tag} is outside MPI's range 0..{self._tag_ub}")

    def _receiver(self, buf, code, src, tag, what):
        """A receive that learns the message's size before MPI may write anything: a matched
        probe (MPI_Improbe), a size check, then MPI_Imrecv. Why not a plain Irecv: a receive
        too small for its message is erroneous in MPI, and Open MPI 5 then writes past the
        buffer's end once the message is over the eager limit (heap corruption, not
        MPI_ERR_TRUNCATE). Nothing is posted before a message is matched, so giving up leaves
        nothing behind to swallow a later message. Returns done() and a list that holds the
        receive request once there is one."""
        MPI, started, status = self._MPI, [], self._MPI.Status()

        def done():
            if not started:
                with self._lock:
                    msg = self.comm.Improbe(src, tag, status)
                if msg is None:
                    return False
                nbytes = status.Get_count(MPI.BYTE)
                if nbytes != buf.nbytes:
                    self._refuse(msg, nbytes, buf, src, what)
                with self._lock:
                    started.append(msg.Irecv(self._buf(buf, code)))
            with self._lock:
                return started[0].Test()
        return done, started

    def _refuse(self, msg, nbytes, buf, src, what):
        """A message of the wrong size: take it off the wire into a scratch buffer (so the
        sender is not left hanging) unless it is too big to allocate, then fail loudly."""
        if nbytes <= max(buf.nbytes, MAX_DRAIN_BYTES):
            sink = np.empty(nbytes, np.uint8)
            with self._lock:
                req = msg.Irecv([sink, self._MPI.BYTE])
            self._wait(self._tester(req), what, lambda: [src], keep=lambda: [req])
        raise MismatchError(f"rank {self._me()}: {what}: the message has {nbytes} bytes but the buffer "
                            f"holds {buf.nbytes} bytes ({buf.size} x {buf.dtype}): the two ranks disagree on "
                            "the message size")

    def _send(self, buf, code, dst, tag):
        self._check_tag(tag)
        what = f"send to rank {self.ranks[dst]} (tag {tag})"
        req = self._call(what, lambda: self.comm.Isend(self._buf(buf, code), dst, tag))
        self._wait(self._tester(req), what, lambda: [dst], keep=lambda: [req], request_only=True)

    def _post_send(self, buf, code, dst, tag):
        """isend is an Isend started now, on the caller's thread. Sends queued on a lane
        thread, each waited to its end, would deadlock a receiver that takes a later tag
        first, once the message is over the eager limit and MPI holds it until the
        receiver matches it (rendezvous)."""
        self._check_tag(tag)
        what = f"isend to rank {self.ranks[dst]} (tag {tag})"
        req = self._call(what, lambda: self.comm.Isend(self._buf(buf, code), dst, tag))
        handle = _Request(lambda: self._wait(self._tester(req), what, lambda: [dst], keep=lambda: [req],
                                             request_only=True))
        return EngineWork(handle, what, contextlib.nullcontext, keep=(buf,))

    # Receives go through MpiReceives (mpi_receives.py): each is posted when it is
    # called, and any thread waiting for one probes them all, so a receive posted
    # later may match first, as in MPI.

    def _recv(self, buf, code, src, tag):
        self._check_tag(tag)
        what = f"recv from rank {self.ranks[src]} (tag {tag})"
        self._await(*self._posted_receive(buf, code, src, tag, what), src, what)

    def _post_recv(self, buf, code, src, tag):
        self._check_tag(tag)
        what = f"irecv from rank {self.ranks[src]} (tag {tag})"
        entry, started = self._posted_receive(buf, code, src, tag, what, concurrent.futures.Future())
        deadline = time.monotonic() + self.timeout   # from posting, not from its lane job's turn
        return posted_work(self._lanes, f"recv-{src}", entry.future,
                           lambda: self._await(entry, started, src, what, deadline), what)

    def _posted_receive(self, buf, code, src, tag, what, future=None):
        receive, started = self._receiver(buf, code, src, tag, what)

        def progress():   # run by whichever thread progresses it: MPI's errors made ours there
            try:
                return receive()
            except self._MPI.Exception as e:
                raise self._error(e, what) from e
        return self._posted.post(MpiReceive(src, tag, progress, future)), started

    def _await(self, entry, started, src, what, deadline=None):
        """Advance every posted receive until ``entry`` is done; at the deadline (default:
        the timeout from now) the receive is withdrawn, so no later message lands in it."""
        try:
            self._wait(lambda: self._posted.done(entry), what, lambda: [src], keep=lambda: started,
                       deadline=deadline)
        except BaseException:
            self._posted.withdraw(entry)
            raise
        if entry.error is not None:   # raised in whichever thread advanced it
            raise entry.error

    def _sendrecv(self, send_buf, dst, recv_buf, src, code, tag):
        self._check_tag(tag)
        what = f"sendrecv to rank {self.ranks[dst]} / from rank {self.ranks[src]} (tag {tag})"
        req = self._call(what, lambda: self.comm.Isend(self._buf(send_buf, code), dst, tag))
        sent, (received, started) = self._tester(req), self._receiver(recv_buf, code, src, tag, what)
        state = [False, False]

        def done():
            state[0] = state[0] or received()
            state[1] = state[1] or sent()
            return state[0] and state[1]
        self._wait(done, what, lambda: [src] if not state[0] else [dst], keep=lambda: [req] + started)

    # ---- collectives --------------------------------------------------------------

    def _op(self, op):
        MPI = self._MPI
        return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op]

    def _all_reduce(self, buf, code, op):
        if code in _HALF:
            self._half_reduce(buf, code, op, None)
            return
        self._coll("all_reduce", lambda: self.comm.Iallreduce(self._MPI.IN_PLACE, self._buf(buf, code),
                                                              self._op(op)))
        if op == "avg":
            ops.finish_avg(buf, self.world_size, code)

    def _reduce(self, buf, code, op, dst):
        if code in _HALF:
            self._half_reduce(buf, code, op, dst)
            return
        MPI, b = self._MPI, self._buf(buf, code)
        if self.rank == dst:
            self._coll("reduce", lambda: self.comm.Ireduce(MPI.IN_PLACE, b, self._op(op), dst))
            if op == "avg":
                ops.finish_avg(buf, self.world_size, code)
        else:  # MPI reads our buffer and leaves it as it was
            self._coll("reduce", lambda: self.comm.Ireduce(b, None, self._op(op), dst))

    def _half_reduce(self, buf, code, op, dst):
        """16-bit floats: reduce-scatter by all-to-all, reduce in torch, then all-gather
        (dst=None) or gather to dst. Non-root buffers of a reduce are left unchanged."""
        b = split_bounds(buf.size, self.world_size)
        counts = [b[q + 1] - b[q] for q in range(self.world_size)]
        name = "all_reduce" if dst is None else "reduce"
        acc = self._exchange_and_combine(buf, counts, b[:-1], code, op, name)
        T = datatype(self._MPI, code)
        if dst is None:
            self._coll(name, lambda: self.comm.Iallgatherv([acc, T], [buf, (counts, b[:-1]), T]))
        else:
            recv = [buf, (counts, b[:-1]), T] if self.rank == dst else None
            self._coll(name, lambda: self.comm.Igatherv([acc, T], recv, dst))

    def _exchange_and_combine(self, send, counts, displs, code, op, name):
        """Piece q of ``send`` (counts[q] elements at displs[q]) goes to rank q; returns this
        rank's piece reduced over all ranks, combined in rank order 0..P-1."""
        P, n, T = self.world_size, counts[self.rank], datatype(self._MPI, code)
        recv = np.empty(P * n, send.dtype)
        self._coll(name, lambda: self.comm.Ialltoallv([send, (counts, displs), T],
                                                      [recv, ([n] * P, [q * n for q in range(P)]), T]))
        parts = recv.reshape(P, n)
        acc = parts[0].copy() if P == 1 else np.empty(n, send.dtype)
        if P > 1:
            ops.combine(acc, parts[0], parts[1], op, code)
            for q in range(2, P):
                ops.combine(acc, acc, parts[q], op, code)
        if op == "avg":
            ops.finish_avg(acc, P, code)
        return acc

    def _barrier(self):
        self._coll("barrier", lambda: self.comm.Ibarrier())

    def _broadcast(self, buf, code, src):
        self._coll("broadcast", lambda: self.comm.Ibcast(self._buf(buf, code), src))

    def _landing(self, pieces, like):
        """Where MPI writes pieces that travel as one buffer: the pieces themselves if they lie
        end to end (views of one tensor), else a scratch buffer copied out with _unpack."""
        span = ops.span(pieces)
        return np.empty(sum(p.size for p in pieces), like.dtype) if span is None else span, span

    def _all_gather_into(self, out, buf, code):
        n, T = buf.size, datatype(self._MPI, code)
        recv, span = self._landing(out, buf)
        # In place (ZeRO gathers its shards so) our piece is already there, unless MPI lands in scratch.
        if recv is not span or not same(buf, out[self.rank]):
            recv[self.rank * n:(self.rank + 1) * n] = buf
        self._coll("all_gather", lambda: self.comm.Iallgather(self._MPI.IN_PLACE, [recv, T]))
        if recv is not span:
            unpack(recv, out)

    def _gather(self, out, buf, code, dst):
        n, T = buf.size, datatype(self._MPI, code)
        if self.rank != dst:
            self._coll("gather", lambda: self.comm.Igather([buf, T], None, dst))
            return
        recv, span = self._landing(out, buf)
        if recv is not span or not same(buf, out[dst]):
            recv[dst * n:(dst + 1) * n] = buf
        self._coll("gather", lambda: self.comm.Igather(self._MPI.IN_PLACE, [recv, T], dst))
        if recv is not span:
            unpack(recv, out)

    def _scatter(self, buf, inp, code, src):
        T = datatype(self._MPI, code)
        if self.rank != src:
            self._coll("scatter", lambda: self.comm.Iscatter(None, [buf, T], src))
            return
        send = sending(inp)
        self._coll("scatter", lambda: self.comm.Iscatter([send, T], self._MPI.IN_PLACE, src))
        if not same(buf, inp[src]):
            buf[...] = inp[src]  # numpy copes if they overlap

    def _reduce_scatter(self, out, inp, code, op):
        n, T, send = out.size, datatype(self._MPI, code), sending(inp)
        if code in _HALF:
            out[...] = self._exchange_and_combine(send, [n] * self.world_size,
                                                  [q * n for q in range(self.world_size)],
                                                  code, op, "reduce_scatter")
            return
        # out may be a piece of the input (ZeRO's in-place pattern); MPI forbids that aliasing.
        recv = np.empty_like(out) if np.may_share_memory(out, send) else out
        self._coll("reduce_scatter",
                   lambda: self.comm.Ireduce_scatter_block([send, T], [recv, T], self._op(op)))
        if recv is not out:
            out[...] = recv
        if op == "avg":
            ops.finish_avg(out, self.world_size, code)

    def _all_to_all(self, out, inp, code, even):
        T, send = datatype(self._MPI, code), sending(inp)
        recv, span = self._landing(out, send)
        if np.may_share_memory(recv, send):
            recv = np.empty_like(recv)
        if even:
            self._coll("all_to_all", lambda: self.comm.Ialltoall([send, T], [recv, T]))
        else:
            def spec(buf, pieces):
                counts = [p.size for p in pieces]
                return [buf, (counts, [int(d) for d in np.cumsum([0] + counts[:-1])]), T]
            self._coll("all_to_all", lambda: self.comm.Ialltoallv(spec(send, inp), spec(recv, out)))
        if recv is not span:
            unpack(recv, out)

    def split(self, ranks, what):
        """A group over ``ranks`` (global ranks) split from this one's communicator, rank i
        of it being ranks[i]; None on non-members. Every rank of this group calls it.
        MPI's Split blocks with no timeout, so every rank first shows up and agrees on
        the list in an all-gather that does time out; once that completed, the Split
        has everyone it waits for."""
        self._lanes.drain("coll")  # a pending async collective on the same communicator comes first
        if len(set(ranks)) != len(ranks) or min(ranks, default=-1) < 0:
            raise ValueError(f"{what}: ranks {ranks} must be distinct global ranks")
        MPI, me = self._MPI, self._me()
        row = np.array([len(ranks), zlib.crc32(np.array(ranks, np.int64).tobytes())], np.int64)
        rows = np.empty(2 * self.world_size, np.int64)
        self._coll("all_gather", lambda: self.comm.Iallgather([row, MPI.INT64_T], [rows, MPI.INT64_T]),
                   f"{what} (agreeing on its ranks {ranks})")
        rows = rows.reshape(-1, 2)
        bad = [self.ranks[i] for i in range(len(rows)) if not np.array_equal(rows[i], row)]
        if bad:
            raise MismatchError(f"{what}: rank {me} asked for a group of ranks {ranks}, but ranks {bad} "
                                "asked for a different list; every rank must pass the same ranks")
        member = me in ranks
        with self._lock:
            comm = self.comm.Split(0 if member else MPI.UNDEFINED, ranks.index(me) if member else 0)
        return MpiGroup(comm, ranks, self.timeout) if member else None

    def destroy(self):
        super().destroy()
        MPI = self._MPI
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL) and not MPI.Is_finalized():
            with contextlib.suppress(MPI.Exception):
                self.comm.Free()
        self.comm = MPI.COMM_NULL


# ---- building groups ------------------------------------------------------------------


def mpi_world(timeout=None):
    """The group of every process mpirun started, over a private duplicate of COMM_WORLD."""
    MPI = mpi()
    timeout = timeout_from_env() if timeout is None else float(timeout)
    world = MPI.COMM_WORLD
    me, size = world.Get_rank(), world.Get_size()
    said = os.environ.get("WORLD_SIZE")
    if said is not None and said.strip() != str(size):
        # e.g. `paratrain run -n 2` or torchrun starting a script that asks for mpi: each
        # process is an MPI world of its own, and would compute alone, silently
        raise CommError(
            f"pt.init(backend='mpi') found an MPI world of {size} process(es), but WORLD_SIZE={said} says the "
            f"job has {said}: backend='mpi' takes its ranks from MPI, so start the job with `mpirun -n {said} "
            "python -m mpi4py script.py`, or keep this launcher and choose another backend (the default, "
            "or 'torch')")
    comm, req = world.Idup()
    poll(req.Test, timeout, lambda: timed_out(
        me, timeout, "pt.init(backend='mpi')", [r for r in range(size) if r != me],
        f"not all {size} processes started by mpirun called it", hint=""))
    return MpiGroup(comm, list(range(size)), timeout)


def mpi_new_group(world_group, ranks):
    """A group over ``ranks`` (global ranks) split from the world group; None on non-members.
    Every rank of the world must call it with the same list."""
    return world_group.split([int(r) for r in ranks], "new_group")


def mpi_subgroup(global_ranks, me, timeout=None):
    """A group over ``global_ranks`` split from COMM_WORLD (the leaders of a hierarchical
    group); None on non-members. Every process of COMM_WORLD must call it. Needs the
    job to be started by mpirun, so that paratrain's global ranks are the MPI ranks."""
    MPI = mpi()
    world = MPI.COMM_WORLD
    ranks = [int(r) for r in global_ranks]
    if world.Get_rank() != me or max(ranks) >= world.Get_size():
        raise CommError(
            f"mpi_subgroup: paratrain rank {me} is MPI rank {world.Get_rank()} of {world.Get_size()}; "
            "the MPI cross-host engine needs the job started by mpirun so the two agree "
            "(or set PARATRAIN_CROSS_BACKEND=torch)")
    return MpiGroup(world, list(range(world.Get_size())), timeout).split(ranks, "mpi_subgroup")


class _Request:
    """An MPI request as EngineWork's handle: ``wait`` is the group's poll of it with
    the group's timeout, which raises paratrain's errors itself (hence EngineWork's
    ``errors`` is a no-op, contextlib.nullcontext)."""

    __slots__ = ("wait",)

    def __init__(self, wait):
        self.wait = wait
