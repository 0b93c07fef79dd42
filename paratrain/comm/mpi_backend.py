"""MpiGroup: the ProcessGroup API over MPI (mpi4py), for jobs started by ``mpirun``.

``pt.init(backend="mpi")`` runs every collective on the MPI library's own
implementation (Open MPI's tuned/libnbc, MPICH's, a vendor's), the engine HPC
clusters already tune for their network; ``algorithm="ring"/"tree"/"naive"``
runs the portable algorithms of comm/algorithms/ over MPI point-to-point
instead, which is how the benchmark compares them on the same transport.

Three things MPI does not give us, and what we do about them:

- **No wait may last forever**, but MPI's blocking calls cannot time out. Every
  call is the nonblocking variant (Isend, Irecv, and the MPI-3 nonblocking
  collectives Iallreduce, Ibarrier, ...), completed by polling ``Test``: a few
  tries at once, since a small message is often already there, then 200 us of
  testing if the host has a core per rank, then sleeps doubling from 20 us to
  1 ms, so a waiting rank leaves its core to the others (``mpirun
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
import contextlib
import os
import threading
import time
import zlib

import numpy as np

from . import ops
from .algorithms import split_bounds
from .errors import CommError, CommTimeout, MismatchError
from .group import COLL_CODE, ProcessGroup, describe, timeout_from_env

SPIN_TESTS = 32          # Test() calls at once: a small message is often there by then
SPIN_S = 200e-6          # then keep testing for 200 us if cores allow (_spin_seconds) ...
SLEEP_FIRST = 20e-6      # ... then sleep, doubling from 20 us ...
SLEEP_MAX = 1e-3         # ... to 1 ms: worst added latency 1 ms, and an idle rank costs ~nothing
_HALF = (1, 2)           # float16, bfloat16: MPI has no reduction for them


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError("backend='mpi' needs mpi4py and an MPI library: pip install paratrain[mpi] "
                          f"(importing mpi4py failed: {e})") from e
    return MPI


def _datatype(MPI, code):
    """The MPI datatype a buffer of dtype ``code`` travels as (16-bit floats as raw uint16)."""
    return {1: MPI.UINT16_T, 2: MPI.UINT16_T, 3: MPI.FLOAT, 4: MPI.DOUBLE,
            5: MPI.INT32_T, 6: MPI.INT64_T, 7: MPI.UINT8_T}[code]


def _addr(a):
    return a.__array_interface__["data"][0]


def _span(pieces):
    """One flat view over pieces lying end to end in memory (views of one tensor, as
    all_gather_into_tensor passes), so MPI can write them in one call; else None."""
    first, total = pieces[0], sum(p.size for p in pieces)
    if total == 0:
        return np.empty(0, first.dtype)
    at = _addr(first)
    for p in pieces:
        if _addr(p) != at:
            return None
        at += p.nbytes
    # The view covers exactly the pieces' bytes, so writing it writes only them.
    return np.lib.stride_tricks.as_strided(first, shape=(total,), strides=(first.itemsize,))


def _same(a, b):
    return a.size == b.size and _addr(a) == _addr(b)


def _spin_seconds():
    """How long a waiting rank polls before it starts sleeping: 200 us (as ShmGroup spins)
    unless this host runs more ranks than it has cores, where spinning steals the core the
    awaited peer needs. PARATRAIN_MPI_SPIN_US overrides."""
    v = os.environ.get("PARATRAIN_MPI_SPIN_US")
    if v is not None:
        return float(v) * 1e-6
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or os.environ.get("MPI_LOCALNRANKS") or "1"
    return 0.0 if int(local) > len(os.sched_getaffinity(0)) else SPIN_S


def _poll(MPI, reqs, timeout, lock, on_timeout, statuses=None, spin_s=0.0):
    """Wait for every request by polling (see the module docstring); on_timeout() builds the error.
    MPI's nonblocking collectives advance only inside MPI calls, so the Tests also make progress."""
    def done():
        with lock:
            if len(reqs) == 1:
                return reqs[0].Test(statuses[0] if statuses else None)
            return MPI.Request.Testall(reqs, statuses)
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


class MpiGroup(ProcessGroup):
    backend = "mpi"
    native_algorithms = ("native",)

    def __init__(self, comm, ranks, timeout=None):
        """comm: an mpi4py intracommunicator; ranks: the global rank of each of its members."""
        MPI = self._MPI = _mpi()
        super().__init__(comm.Get_rank(), comm.Get_size(), ranks, timeout)
        if len(self.ranks) != self.world_size:
            raise ValueError(f"MpiGroup: {len(self.ranks)} global ranks given for a communicator of "
                             f"{self.world_size}")
        self.comm = comm
        self._tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767  # the attribute lives on COMM_WORLD only
        # Lanes call MPI from several threads; below THREAD_MULTIPLE, one call at a time.
        self._lock = (contextlib.nullcontext() if MPI.Query_thread() >= MPI.THREAD_MULTIPLE
                      else threading.Lock())
        self._spin_s = _spin_seconds()
        self._abandoned = []  # timed-out requests: kept, with their buffers, until MPI lets go
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

    def _wait(self, reqs, what, peer=None, statuses=None, recv=None):
        """Poll ``reqs`` to completion or raise CommTimeout naming ``what`` (and ``peer``,
        group-local, for point-to-point). ``recv``: the receive to withdraw on timeout."""
        MPI = self._MPI

        def on_timeout():
            self._abandon(reqs, recv)
            if peer is not None:
                return CommTimeout(
                    f"rank {self._me()} timed out after {self.timeout:g}s in {what} (rank {self.ranks[peer]} "
                    "did not answer); raise PARATRAIN_TIMEOUT if it is legitimately slow", [self.ranks[peer]])
            others = [g for i, g in enumerate(self.ranks) if i != self.rank]
            return CommTimeout(
                f"rank {self._me()} timed out after {self.timeout:g}s in {what} over MPI waiting for ranks "
                f"{others} (MPI cannot say which are missing). Ranks must call the same collectives in the "
                "same order; raise PARATRAIN_TIMEOUT if a rank is legitimately slow", others)
        try:
            _poll(MPI, reqs, self.timeout, self._lock, on_timeout, statuses, self._spin_s)
        except MPI.Exception as e:
            raise self._error(e, what) from e

    def _abandon(self, reqs, recv):
        """A receive nobody matched is cancelled, so it cannot swallow a later message. Sends
        and collectives cannot be withdrawn (MPI forbids cancelling a collective): they stay
        pending, their buffers kept alive here in case MPI completes them later."""
        if recv is not None:
            with contextlib.suppress(self._MPI.Exception), self._lock:
                recv.Cancel()
        self._abandoned.extend(reqs)

    def _coll(self, name, start, what=None):
        what = what or self._what(name)
        self._wait([self._call(what, start)], what)

    # ---- point to point (group-local ranks) ------------------------------------------

    def _buf(self, buf, code):
        return [buf, _datatype(self._MPI, code)]

    def _check_tag(self, tag):
        if not 0 <= tag <= self._tag_ub:
            raise ValueError(f"tag {tag} is outside MPI's range 0..{self._tag_ub}")

    def _check_count(self, status, buf, code, what):
        got = status.Get_count(_datatype(self._MPI, code))
        if got != buf.size:
            raise MismatchError(f"rank {self._me()}: {what} received {got} elements into a buffer of "
                                f"{buf.size}: the two ranks disagree on the message size")

    def _send(self, buf, code, dst, tag):
        self._check_tag(tag)
        what = f"send to rank {self.ranks[dst]} (tag {tag})"
        req = self._call(what, lambda: self.comm.Isend(self._buf(buf, code), dst, tag))
        self._wait([req], what, dst)

    def _recv(self, buf, code, src, tag):
        self._check_tag(tag)
        what = f"recv from rank {self.ranks[src]} (tag {tag})"
        req = self._call(what, lambda: self.comm.Irecv(self._buf(buf, code), src, tag))
        status = self._MPI.Status()
        self._wait([req], what, src, [status], recv=req)
        self._check_count(status, buf, code, what)

    def _sendrecv(self, send_buf, dst, recv_buf, src, code, tag):
        self._check_tag(tag)
        what = f"sendrecv to rank {self.ranks[dst]} / from rank {self.ranks[src]} (tag {tag})"
        reqs = self._call(what, lambda: [self.comm.Irecv(self._buf(recv_buf, code), src, tag),
                                         self.comm.Isend(self._buf(send_buf, code), dst, tag)])
        statuses = [self._MPI.Status(), self._MPI.Status()]
        self._wait(reqs, what, src, statuses, recv=reqs[0])
        self._check_count(statuses[0], recv_buf, code, what)

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
        T = _datatype(self._MPI, code)
        if dst is None:
            self._coll(name, lambda: self.comm.Iallgatherv([acc, T], [buf, (counts, b[:-1]), T]))
        else:
            recv = [buf, (counts, b[:-1]), T] if self.rank == dst else None
            self._coll(name, lambda: self.comm.Igatherv([acc, T], recv, dst))

    def _exchange_and_combine(self, send, counts, displs, code, op, name):
        """Piece q of ``send`` (counts[q] elements at displs[q]) goes to rank q; returns this
        rank's piece reduced over all ranks, combined in rank order 0..P-1."""
        P, n, T = self.world_size, counts[self.rank], _datatype(self._MPI, code)
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

    def _all_gather_into(self, out, buf, code):
        T, span = _datatype(self._MPI, code), _span(out)
        if span is None:  # scattered output pieces: gather into one buffer, then copy out
            tmp = np.empty(buf.size * self.world_size, buf.dtype)
            self._coll("all_gather", lambda: self.comm.Iallgather([buf, T], [tmp, T]))
            for q, o in enumerate(out):
                o[...] = tmp[q * buf.size:(q + 1) * buf.size]
            return
        if _same(buf, out[self.rank]):  # gathering in place, as ZeRO does
            send = self._MPI.IN_PLACE
        else:
            send = [buf.copy() if np.may_share_memory(buf, span) else buf, T]
        self._coll("all_gather", lambda: self.comm.Iallgather(send, [span, T]))

    def _gather(self, out, buf, code, dst):
        T = _datatype(self._MPI, code)
        if self.rank != dst:
            self._coll("gather", lambda: self.comm.Igather([buf, T], None, dst))
            return
        span = _span(out)
        if span is None:
            tmp = np.empty(buf.size * self.world_size, buf.dtype)
            self._coll("gather", lambda: self.comm.Igather([buf, T], [tmp, T], dst))
            for q, o in enumerate(out):
                o[...] = tmp[q * buf.size:(q + 1) * buf.size]
            return
        if not _same(buf, out[dst]):
            out[dst][...] = buf.copy() if np.may_share_memory(buf, span) else buf
        self._coll("gather", lambda: self.comm.Igather(self._MPI.IN_PLACE, [span, T], dst))

    def _scatter(self, buf, inp, code, src):
        T = _datatype(self._MPI, code)
        if self.rank != src:
            self._coll("scatter", lambda: self.comm.Iscatter(None, [buf, T], src))
            return
        span = _span(inp)
        send = np.concatenate(inp) if span is None or np.may_share_memory(buf, span) else span
        self._coll("scatter", lambda: self.comm.Iscatter([send, T], self._MPI.IN_PLACE, src))
        if not _same(buf, inp[src]):
            buf[...] = send[src * buf.size:(src + 1) * buf.size]

    def _reduce_scatter(self, out, inp, code, op):
        n, T = out.size, _datatype(self._MPI, code)
        span = _span(inp)
        send = np.concatenate(inp) if span is None else span
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
        T = _datatype(self._MPI, code)
        send_span, recv_span = _span(inp), _span(out)
        send = np.concatenate(inp) if send_span is None else send_span
        recv = recv_span
        if recv is None or np.may_share_memory(recv, send):
            recv = np.empty(sum(o.size for o in out), send.dtype)
        if even:
            self._coll("all_to_all", lambda: self.comm.Ialltoall([send, T], [recv, T]))
        else:
            def spec(buf, pieces):
                counts = [p.size for p in pieces]
                return [buf, (counts, [int(d) for d in np.cumsum([0] + counts[:-1])]), T]
            self._coll("all_to_all", lambda: self.comm.Ialltoallv(spec(send, inp), spec(recv, out)))
        if recv is not recv_span:
            off = 0
            for o in out:
                o[...] = recv[off:off + o.size]
                off += o.size

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
    MPI = _mpi()
    timeout = timeout_from_env() if timeout is None else float(timeout)
    world = MPI.COMM_WORLD
    comm, req = world.Idup()
    me, size = world.Get_rank(), world.Get_size()
    _poll(MPI, [req], timeout, contextlib.nullcontext(), lambda: CommTimeout(
        f"rank {me} timed out after {timeout:g}s in pt.init(backend='mpi'): not all {size} processes "
        "started by mpirun called it", [r for r in range(size) if r != me]))
    return MpiGroup(comm, list(range(size)), timeout)


def mpi_new_group(world_group, ranks):
    """A group over ``ranks`` (global ranks) split from the world group; None on non-members.
    Every rank of the world must call it with the same list."""
    world_group._lanes.drain("coll")  # a pending async collective on the same communicator comes first
    ranks = [int(r) for r in ranks]
    me = world_group.ranks[world_group.rank]
    comm = _split(world_group.comm, ranks, me, world_group, "new_group")
    return MpiGroup(comm, ranks, world_group.timeout) if comm is not None else None


def mpi_subgroup(global_ranks, me, timeout=None):
    """A group over ``global_ranks`` split from COMM_WORLD (the leaders of a hierarchical
    group); None on non-members. Every process of COMM_WORLD must call it. Needs the
    job to be started by mpirun, so that paratrain's global ranks are the MPI ranks."""
    MPI = _mpi()
    world = MPI.COMM_WORLD
    ranks = [int(r) for r in global_ranks]
    if world.Get_rank() != me or max(ranks) >= world.Get_size():
        raise CommError(
            f"mpi_subgroup: paratrain rank {me} is MPI rank {world.Get_rank()} of {world.Get_size()}; "
            "the MPI cross-host engine needs the job started by mpirun so the two agree "
            "(or set PARATRAIN_CROSS_BACKEND=torch)")
    helper = MpiGroup(world, list(range(world.Get_size())), timeout)
    comm = _split(world, ranks, me, helper, "mpi_subgroup")
    return MpiGroup(comm, ranks, helper.timeout) if comm is not None else None


def _split(parent, ranks, me, via, what):
    """Split ``parent`` so rank i of the new communicator is ranks[i]. MPI's Split blocks with
    no timeout, so every rank first shows up and agrees on the list in an all-gather that does
    time out; once that completed, the Split has everyone it waits for."""
    if len(set(ranks)) != len(ranks) or min(ranks, default=-1) < 0:
        raise ValueError(f"{what}: ranks {ranks} must be distinct global ranks")
    MPI = via._MPI
    row = np.array([len(ranks), zlib.crc32(np.array(ranks, np.int64).tobytes())], np.int64)
    rows = np.empty(2 * via.world_size, np.int64)
    via._coll("all_gather", lambda: parent.Iallgather([row, MPI.INT64_T], [rows, MPI.INT64_T]),
              f"{what} (agreeing on its ranks {ranks})")
    rows = rows.reshape(-1, 2)
    bad = [via.ranks[i] for i in range(len(rows)) if not np.array_equal(rows[i], row)]
    if bad:
        raise MismatchError(f"{what}: rank {me} asked for a group of ranks {ranks}, but ranks {bad} "
                            "asked for a different list; every rank must pass the same ranks")
    member = me in ranks
    with via._lock:
        comm = parent.Split(0 if member else MPI.UNDEFINED, ranks.index(me) if member else 0)
    return comm if member else None
