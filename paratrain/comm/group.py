"""ProcessGroup: the one collective API every backend offers.

Names and argument order follow torch.distributed so that code moves over
unchanged: ``all_reduce(tensor, op="sum", async_op=False)`` and so on. Tensors
are CPU torch tensors or numpy arrays (the torch backend hands torch tensors on
any device to torch.distributed as they are); results are written in place.

This base class owns what is the same for every backend: argument checking,
the ``async_op`` lanes, the debug-mode check that all ranks called the same
thing, and the choice of algorithm. A backend provides point-to-point
``_send``/``_recv`` of flat buffers and may override any ``_<collective>``
with a faster native version; every collective also has a portable version
built from point-to-point in ``comm/algorithms/``, so a new backend works as
soon as it can send and receive. The algorithms see the backend only through
``self.transport`` (comm/transport.py), built here from those methods.
"""

import functools
import time

import numpy as np

from .. import config
from ..trace import calls as trace_calls, flight, recorder as trace
from . import abandon, envelopes, ops
from .algorithms import TAG as INTERNAL_TAG, naive, ring, tree
from .errors import CommError, MismatchError
from .transport import Transport
from .work import Lanes


def _check_tag(tag, what):
    """A user's tag: an int below INTERNAL_TAG, where the collective algorithms' own
    messages start, so a user's message is never taken for one of theirs. (The mpi
    backend also checks the tag against its library's bound.)"""
    if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool) or not 0 <= tag < INTERNAL_TAG:
        raise ValueError(f"{what}: tag {tag!r} must be an int from 0 to {INTERNAL_TAG - 1} "
                         "(higher tags are reserved for paratrain's own collective algorithms)")
    return int(tag)

# Descriptor codes: what a rank says it is calling, compared across ranks.
COLLECTIVES = ("barrier", "broadcast", "reduce", "all_reduce", "reduce_scatter",
               "all_gather", "gather", "scatter", "all_to_all")
COLL_CODE = {name: i + 1 for i, name in enumerate(COLLECTIVES)}

ALGORITHMS = {"naive": naive, "ring": ring, "tree": tree}


def timeout_from_env():
    return config.get("PARATRAIN_TIMEOUT")


def debug_checks():
    return config.get("PARATRAIN_DEBUG")


def describe(desc):
    """Human words for a descriptor row [seq, coll, op, dtype, numel, root, extra, _]."""
    seq, coll, op, code, numel, root, extra, *_ = (int(x) for x in desc)
    name = COLLECTIVES[coll - 1] if 1 <= coll <= len(COLLECTIVES) else f"collective #{coll}"
    parts = []
    if code:
        parts.append(f"{str(ops.CODE_TORCH.get(code, code)).replace('torch.', '')} x {numel}")
    if op:
        parts.append(f"op={ops.REDUCE_OPS[op - 1]}")
    if name in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root={root}")
    if name in ("all_reduce", "all_gather", "reduce_scatter"):
        parts.append(f"in shared buffer #{(extra >> 40) - 1} at byte {extra & ((1 << 40) - 1)}" if extra
                     else "in private memory")
    return f"{name}({', '.join(parts)}) [call #{seq}]"


def check_descriptors(rows, what, ranks):
    """Raise MismatchError naming the disagreeing ranks if the rows are not all equal."""
    rows = np.asarray(rows)
    same = rows[:, 1:7] == rows[0, 1:7]
    if not same.all():
        bad = [i for i in range(len(rows)) if not same[i].all()]
        lines = [f"  rank {ranks[i]}: {describe(rows[i])}" for i in range(len(rows))]
        what = what() if callable(what) else what
        raise MismatchError(
            f"ranks called different collectives or with different shapes/dtypes/ops in {what}; "
            f"ranks {[ranks[i] for i in bad]} disagree with rank {ranks[0]}:\n" + "\n".join(lines))


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else None


class ProcessGroup:
    """A set of ranks that communicate. ``rank`` is this process's index in the group."""

    backend = "base"
    lane_stop_seconds = 0.0   # how long destroy() lets running lane work notice it and end
    receives_posted_when_called = False   # shm, mpi: an irecv is matchable from its call on
    messages_carry_dtype = False   # shm: every message says its dtype and size (else see envelopes.py)

    def __init__(self, rank, world_size, ranks=None, timeout=None):
        self.rank = rank
        self.world_size = world_size
        self.ranks = list(ranks) if ranks is not None else list(range(world_size))  # global ranks
        self.timeout = timeout_from_env() if timeout is None else float(timeout)
        self._lanes = Lanes(f"paratrain-{self.backend}")
        # What the collective algorithms may use of this group, and all they may use.
        self.transport = Transport(rank, world_size, self._send, self._recv, self._sendrecv,
                                   self._post_send, self._post_recv)
        self._seq = 0
        self._debug = debug_checks()
        self._envelopes = self._debug and not self.messages_carry_dtype   # envelopes.py
        self._closed_channels = {}   # envelopes.py: (src, tag) left with an undrained message, and why
        self._env_algo = config.get("PARATRAIN_ALGO")
        self._destroyed = False
        self._trace_bytes, self._trace_algorithm = 0, None   # the call being made, for its trace (trace/calls.py)
        flight.GROUPS.add(self)   # the stall inspector asks every live group how far it got
        self._flight = flight.new_log()

    def __repr__(self):
        return f"<{type(self).__name__} rank {self.rank}/{self.world_size} backend={self.backend}>"

    def size(self):
        return self.world_size

    def calls_made(self):
        """Collectives called on this group so far: the sequence id of the last one."""
        return self._seq

    def is_destroyed(self):
        return self._destroyed

    def get_rank(self):
        return self.rank

    # ---- running blocking or async ------------------------------------------------

    def _run(self, lane, fn, async_op, what):
        self._check_alive(what)
        log = None
        if lane == "coll":
            if trace.ON:
                fn = trace_calls.collective(self, what, self._seq, self._trace_bytes, self._trace_algorithm, fn,
                                            blocking=not async_op)
            log = self._flight
            if log is not None:   # the flight recorder (trace/flight.py): a tuple in, a count on
                seq = self._seq
                log.calls.append((seq, what, self._trace_bytes, time.time(), async_op))
                if async_op:
                    fn = flight.run_async(log, seq, fn, CommError)
        if async_op:
            return self._lanes.submit(lane, fn, what)
        self._lanes.drain(lane)
        if log is None:
            fn()
        else:
            log.run(seq, fn, CommError)
        return None

    def _check_alive(self, what):
        if self._destroyed:
            raise CommError(f"{what} on {self!r}, which was destroyed (pt.destroy() or group.destroy()): "
                            "its peers may be gone; call pt.init() again and use the group it returns")
        abandon.check()   # an elastic job's launcher declared a member of this world dead

    def _check_peer(self, peer, what):
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.world_size:
            raise ValueError(f"{what}: rank {peer!r} is not in this group of {self.world_size} ranks "
                             "(ranks are group-local: 0..world_size-1)")
        return int(peer)

    def _descriptor(self, coll, code=0, op=None, numel=0, root=0, extra=0):
        """(seq, collective, op, dtype, numel, root, extra, signature): what this rank is
        calling. Ranks agree when their signatures (a hash of fields 1-6) agree; a
        tuple, since this runs on every call and a small-message call is all overhead.
        It counts the call (seq), so every check that may refuse a call runs before it:
        a call refused on one rank only must leave the ranks' counts equal."""
        self._seq += 1
        if trace.ON or self._flight is not None:
            self._trace_bytes = int(numel) * ops.itemsize(code) if code else 0
        fields = (COLL_CODE[coll], ops.REDUCE_CODE[op] if op else 0, code, int(numel), int(root), extra)
        return (self._seq, *fields, hash(fields) & 0x7FFFFFFFFFFFFFFF)

    def _agree(self, desc):
        """Make sure every rank is calling the same thing (debug mode on backends
        without a cheaper always-on check)."""
        if self._debug and self.world_size > 1:
            rows = np.zeros((self.world_size, 8), dtype=np.int64)
            self._all_gather(rows.reshape(-1), np.array(desc, dtype=np.int64), ops.INT64)
            check_descriptors(rows, describe(desc), self.ranks)

    def _algorithm(self, algorithm, nbytes):
        name = algorithm or self._env_algo or self.default_algorithm(nbytes)
        self._trace_algorithm = name
        if name in ALGORITHMS:
            return ALGORITHMS[name]
        native = getattr(self, "native_algorithms", ())
        if name in native:
            return None
        raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(set(ALGORITHMS) | set(native))}")

    def default_algorithm(self, nbytes):
        """Small messages are latency-bound: tree (log P steps); large ones ring (bandwidth-optimal)."""
        return "tree" if nbytes <= 64 * 1024 else "ring"

    # ---- point to point -----------------------------------------------------------

    # Portable fallback: each peer has its own send lane and its own receive lane
    # (work.py): an irecv from one peer never waits behind an irecv from another
    # (torch.distributed and MPI let the second complete first), while messages to
    # or from one peer keep the order they were issued in, as MPI's non-overtaking
    # rule asks. The backends do better (_post_send/_post_recv): torch's isend/irecv
    # and MPI's isend are the engines' own, and shm and mpi post a receive when it
    # is called, so its Work is done once its message is in (work.posted_work).

    def send(self, tensor, dst, tag=0):
        if flight.RING is None and not trace.ON:
            return self._send_call(tensor, dst, tag)
        return self._recorded("send", "send", tensor, dst, tag, self._send_call)

    def recv(self, tensor, src, tag=0):
        if flight.RING is None and not trace.ON:
            return self._recv_call(tensor, src, tag)
        return self._recorded("recv", "recv", tensor, src, tag, self._recv_call)

    def _recorded(self, name, direction, tensor, peer, tag, call):
        """A blocking send or receive, in the flight recorder (its peer as a global rank) and,
        when the run is traced, in the trace."""
        checked, checked_tag, nbytes = self._traced_peer(tensor, peer, tag, name)

        def run():
            return call(tensor, peer, tag)
        if trace.ON:
            run = functools.partial(trace_calls.point_to_point, self, name, direction, checked, checked_tag, nbytes,
                                    run)
        ring = flight.RING
        if ring is None:
            return run()
        slot = ring.message(trace_calls.group_name(self), name, nbytes, self.ranks[checked])
        try:
            result = run()
        except BaseException as e:
            flight.end(slot, e, CommError)
            raise
        flight.end(slot)
        return result

    def isend(self, tensor, dst, tag=0):
        if trace.ON:
            return trace_calls.posted(self, "isend", "send", *self._traced_peer(tensor, dst, tag, "isend"),
                                      lambda: self._isend_call(tensor, dst, tag))
        return self._isend_call(tensor, dst, tag)

    def irecv(self, tensor, src, tag=0):
        if trace.ON:
            return trace_calls.posted(self, "irecv", "recv", *self._traced_peer(tensor, src, tag, "irecv"),
                                      lambda: self._irecv_call(tensor, src, tag))
        return self._irecv_call(tensor, src, tag)

    def _traced_peer(self, tensor, peer, tag, what):
        """(peer, tag, bytes) of a point-to-point call, for its trace; checked as the call checks them."""
        return (*self._p2p_peer(peer, tag, what), int(getattr(tensor, "nbytes", 0)))

    # The calls themselves; a backend with its own engine overrides them (torch_backend.py).

    def _send_call(self, tensor, dst, tag=0):
        buf, code, dst, tag = self._p2p_args(tensor, dst, tag, "send", writable=False)
        if self._envelopes:
            self._check_alive(f"send to {dst}")
            envelopes.post_send(self.transport, buf, code, dst, tag, self._p2p_what("send", buf, "to", dst, tag)).wait()
            return
        self._run(f"send-{dst}", lambda: self._send(buf, code, dst, tag), False, f"send to {dst}")

    def _recv_call(self, tensor, src, tag=0):
        buf, code, src, tag = self._p2p_args(tensor, src, tag, "recv")
        self._check_alive(f"recv from {src}")
        if self._envelopes:
            self._checked_recv(buf, code, src, tag, "recv").wait()
        else:
            self._blocking_recv(buf, code, src, tag)
        return src

    def _isend_call(self, tensor, dst, tag=0):
        buf, code, dst, tag = self._p2p_args(tensor, dst, tag, "isend", writable=False)
        self._check_alive(f"isend to {dst}")
        if self._envelopes:
            return envelopes.post_send(self.transport, buf, code, dst, tag,
                                       self._p2p_what("isend", buf, "to", dst, tag))
        return self._post_send(buf, code, dst, tag)

    def _irecv_call(self, tensor, src, tag=0):
        buf, code, src, tag = self._p2p_args(tensor, src, tag, "irecv")
        self._check_alive(f"irecv from {src}")
        if self._envelopes:
            return self._checked_recv(buf, code, src, tag, "irecv")
        return self._post_recv(buf, code, src, tag)

    def _checked_recv(self, buf, code, src, tag, name):
        """A receive behind its envelope (PARATRAIN_DEBUG, envelopes.py)."""
        return envelopes.post_recv(self.transport, buf, code, src, tag, self._p2p_what(name, buf, "from", src, tag),
                                   self.ranks, self._lanes, self._closed_channels)

    def _p2p_what(self, name, buf, direction, peer, tag):
        """'irecv of 16 bytes from rank 2 (tag 5)': a point-to-point call as Work labels and errors name it."""
        return f"{name} of {buf.nbytes} bytes {direction} rank {self.ranks[peer]} (tag {tag})"

    def _p2p_args(self, tensor, peer, tag, what, writable=True):
        """The checks every backend makes alike: (flat buffer, dtype code, peer, tag)."""
        buf, code = ops.as_buffer(tensor, f"{what} buffer", writable)
        return (buf, code, *self._p2p_peer(peer, tag, what))

    def _p2p_peer(self, peer, tag, what):
        """(peer, tag), checked. A message to oneself is refused, as torch.distributed
        refuses it (MPI would buffer a small one and hang on a large one)."""
        if peer is None:
            raise ValueError(f"{what}: a peer rank is needed; paratrain has no receive from any "
                             "source (torch.distributed's src=None): name the sender, or gather")
        peer = self._check_peer(peer, what)
        if peer == self.rank:
            raise ValueError(f"{what}: rank {peer} is this rank; a rank cannot send to or receive from "
                             "itself, copy the tensor instead")
        return peer, _check_tag(tag, what)

    def _blocking_recv(self, buf, code, src, tag):
        """recv: after the irecvs from src already on its lane, so that receives
        with one tag match its messages in the order they were posted; no wait
        where receives are posted when called, since posting order already orders them."""
        if not self.receives_posted_when_called:
            self._lanes.drain(f"recv-{src}")
        self._recv(buf, code, src, tag)

    def _post_send(self, buf, code, dst, tag):
        """Start a send and return its Work: here on the peer's send lane, over the
        blocking ``_send``. A backend whose engine has its own nonblocking send
        overrides this (torch_backend.py, mpi_backend.py)."""
        return self._lanes.submit(f"send-{dst}", lambda: self._send(buf, code, dst, tag),
                                  self._p2p_what("isend", buf, "to", dst, tag))

    def _post_recv(self, buf, code, src, tag):
        """Start a receive and return its Work (see _post_send)."""
        return self._lanes.submit(f"recv-{src}", lambda: self._recv(buf, code, src, tag),
                                  self._p2p_what("irecv", buf, "from", src, tag))

    def _send(self, buf, code, dst, tag):
        raise NotImplementedError

    def _recv(self, buf, code, src, tag):
        raise NotImplementedError

    def _sendrecv(self, send_buf, dst, recv_buf, src, code, tag):
        """Send to dst while receiving from src (both may be the same peer): the step of a ring."""
        work = self._lanes.submit(f"send-{dst}", lambda: self._send(send_buf, code, dst, tag), "sendrecv")
        self._recv(recv_buf, code, src, tag)
        work.wait()

    # ---- collectives: public API --------------------------------------------------

    def barrier(self, async_op=False):
        desc = self._descriptor("barrier")
        return self._run("coll", lambda: self._checked(desc, self._barrier), async_op, "barrier")

    def broadcast(self, tensor, src=0, async_op=False):
        buf, code = ops.as_buffer(tensor)
        src = self._check_peer(src, "broadcast")
        desc = self._descriptor("broadcast", code, None, buf.size, src)
        return self._run("coll", lambda: self._checked(desc, self._broadcast, buf, code, src),
                         async_op, "broadcast")

    def all_reduce(self, tensor, op="sum", async_op=False, algorithm=None):
        op = ops.normalize_op(op)
        buf, code = ops.as_buffer(tensor)
        ops.check_op_dtype(op, code)
        algo = self._algorithm(algorithm, buf.nbytes)   # may refuse: before _descriptor counts the call
        desc = self._descriptor("all_reduce", code, op, buf.size, extra=self._placement(buf))
        return self._run("coll", lambda: self._checked(desc, self._all_reduce_with, algo, buf, code, op),
                         async_op, "all_reduce")

    def reduce(self, tensor, dst=0, op="sum", async_op=False):
        op = ops.normalize_op(op)
        buf, code = ops.as_buffer(tensor)
        ops.check_op_dtype(op, code)
        dst = self._check_peer(dst, "reduce")
        desc = self._descriptor("reduce", code, op, buf.size, dst)
        return self._run("coll", lambda: self._checked(desc, self._reduce, buf, code, op, dst),
                         async_op, "reduce")

    def all_gather(self, output, tensor, async_op=False):
        """output: a list of world_size tensors shaped like ``tensor``, or one tensor of
        world_size x tensor.numel() elements (torch's all_gather_into_tensor)."""
        buf, code = ops.as_buffer(tensor, "all_gather input", writable=False)
        out = self._gathered(output, buf, code, "all_gather output")
        desc = self._descriptor("all_gather", code, None, buf.size, extra=self._gather_placement(out, buf))
        return self._run("coll", lambda: self._checked(desc, self._all_gather_into, out, buf, code),
                         async_op, "all_gather")

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        """input: a list of world_size tensors shaped like ``output``, or one tensor of
        world_size x output.numel() elements. Rank r receives the reduction of everyone's piece r."""
        op = ops.normalize_op(op)
        out, code = ops.as_buffer(output, "reduce_scatter output")
        ops.check_op_dtype(op, code)
        inp = self._gathered(input, out, code, "reduce_scatter input", writable=False)
        desc = self._descriptor("reduce_scatter", code, op, out.size, extra=self._placement(inp))
        return self._run("coll", lambda: self._checked(desc, self._reduce_scatter, out, inp, code, op),
                         async_op, "reduce_scatter")

    def gather(self, tensor, gather_list=None, dst=0, async_op=False):
        buf, code = ops.as_buffer(tensor, "gather input", writable=False)
        dst = self._check_peer(dst, "gather")
        out = None
        if self.rank == dst:
            if gather_list is None:
                raise ValueError("gather: the destination rank must pass gather_list")
            out = self._gathered(gather_list, buf, code, "gather_list")
        desc = self._descriptor("gather", code, None, buf.size, dst)
        return self._run("coll", lambda: self._checked(desc, self._gather, out, buf, code, dst),
                         async_op, "gather")

    def scatter(self, tensor, scatter_list=None, src=0, async_op=False):
        buf, code = ops.as_buffer(tensor, "scatter output")
        src = self._check_peer(src, "scatter")
        inp = None
        if self.rank == src:
            if scatter_list is None:
                raise ValueError("scatter: the source rank must pass scatter_list")
            inp = self._gathered(scatter_list, buf, code, "scatter_list", writable=False)
        desc = self._descriptor("scatter", code, None, buf.size, src)
        return self._run("coll", lambda: self._checked(desc, self._scatter, buf, inp, code, src),
                         async_op, "scatter")

    def all_to_all(self, output, input, async_op=False):
        """Piece j of this rank's input goes to rank j, landing as piece (this rank) of its output.
        output/input: lists of world_size tensors, or single tensors split evenly."""
        in_list = _as_list(input)
        if in_list is None:
            flat, code = ops.as_buffer(input, "all_to_all input", writable=False)
            if flat.size % self.world_size:
                raise ValueError(f"all_to_all input has {flat.size} elements, not divisible by world size "
                                 f"{self.world_size}; pass lists for uneven pieces")
            n = flat.size // self.world_size
            inp = [flat[i * n:(i + 1) * n] for i in range(self.world_size)]
        else:
            inp = self._pieces(in_list, "all_to_all input", writable=False)
            code = self._same_code(in_list, "all_to_all input")
        out_list = _as_list(output)
        if out_list is None:
            flat, ocode = ops.as_buffer(output, "all_to_all output")
            if flat.size % self.world_size:
                raise ValueError(f"all_to_all output has {flat.size} elements, not divisible by world size "
                                 f"{self.world_size}")
            n = flat.size // self.world_size
            out = [flat[i * n:(i + 1) * n] for i in range(self.world_size)]
        else:
            out = self._pieces(out_list, "all_to_all output")
            ocode = self._same_code(out_list, "all_to_all output")
        if ocode != code:
            raise TypeError("all_to_all input and output dtypes differ")
        # Single tensors are even pieces on every rank; lists may be uneven, and whether
        # they are cannot be decided locally, so lists always take the pairwise path.
        even = in_list is None and out_list is None
        desc = self._descriptor("all_to_all", code, None, inp[0].size * self.world_size if even else 0, 0, int(even))
        return self._run("coll", lambda: self._checked(desc, self._all_to_all, out, inp, code, even),
                         async_op, "all_to_all")

    # ---- memory ---------------------------------------------------------------------

    def empty_shared(self, numel, dtype=None):
        """A 1-D tensor of ``numel`` elements that collectives can use without copying it in.

        On the shm backend it lives in shared memory that every rank of the group
        can read (shm/shared.py), and ``all_reduce`` on it, or on a slice of it at
        the same place on every rank, skips the copy-in and copy-out. Elsewhere it
        is ordinary memory. Collective: every rank calls it in the same order with
        the same numel and dtype. Contents are uninitialised (zero on shm)."""
        self._check_alive("empty_shared")
        import torch
        return torch.empty(int(numel), dtype=dtype or torch.float32)

    def _placement(self, buf):
        """Where a buffer (or a list of pieces) lives, as a number the descriptor check
        compares across ranks (0: private memory; a backend with shared buffers says which)."""
        return 0

    def _gather_placement(self, out, buf):
        """The placement an all_gather describes: its input's (a backend whose shared
        buffers cannot serve an in-place call in place says otherwise)."""
        return self._placement(buf)

    # ---- argument helpers ---------------------------------------------------------

    def _pieces(self, lst, what, writable=True):
        if len(lst) != self.world_size:
            raise ValueError(f"{what} has {len(lst)} tensors; it needs one per rank ({self.world_size})")
        return [ops.as_buffer(t, f"{what}[{i}]", writable)[0] for i, t in enumerate(lst)]

    def _same_code(self, lst, what):
        codes = {ops.as_buffer(t, what, writable=False)[1] for t in lst}
        if len(codes) > 1:
            raise TypeError(f"{what} mixes dtypes")
        return codes.pop()

    def _gathered(self, output, like, code, what, writable=True):
        """world_size pieces, each shaped like ``like``: from a list or one big tensor."""
        lst = _as_list(output)
        if lst is None:
            flat, ocode = ops.as_buffer(output, what, writable)
            if flat.size != like.size * self.world_size:
                raise ValueError(f"{what} has {flat.size} elements; it needs world_size x {like.size} "
                                 f"= {like.size * self.world_size}")
            pieces = [flat[i * like.size:(i + 1) * like.size] for i in range(self.world_size)]
        else:
            pieces = self._pieces(lst, what, writable)
            ocode = self._same_code(lst, what)
            for i, p in enumerate(pieces):
                if p.size != like.size:
                    raise ValueError(f"{what}[{i}] has {p.size} elements, expected {like.size}")
        if ocode != code:
            raise TypeError(f"{what} dtype differs from the tensor's "
                            f"({ops.CODE_TORCH[ocode]} vs {ops.CODE_TORCH[code]})")
        return pieces

    def _checked(self, desc, fn, *args):
        self._agree(desc)
        self._current = desc
        fn(*args)

    # ---- collectives: portable versions over point-to-point -------------------------
    # A backend overrides these with native ones where it has them.

    def _all_reduce_with(self, algo, buf, code, op):
        if algo is None:
            self._all_reduce(buf, code, op)
        else:
            algo.all_reduce(self.transport, buf, code, op)

    def _all_reduce(self, buf, code, op):
        ring.all_reduce(self.transport, buf, code, op)

    def _barrier(self):
        tree.all_reduce(self.transport, np.zeros(1, np.uint8), ops.UINT8, "max")

    def _broadcast(self, buf, code, src):
        tree.broadcast(self.transport, buf, code, src)

    def _reduce(self, buf, code, op, dst):
        tree.reduce(self.transport, buf, code, op, dst)

    def _all_gather_into(self, out, buf, code):
        naive.all_gather(self.transport, out, buf, code)

    def _all_gather(self, out_flat, buf, code):
        n = buf.size
        self._all_gather_into([out_flat[i * n:(i + 1) * n] for i in range(self.world_size)], buf, code)

    def _reduce_scatter(self, out, inp, code, op):
        naive.reduce_scatter(self.transport, out, inp, code, op)

    def _gather(self, out, buf, code, dst):
        naive.gather(self.transport, out, buf, code, dst)

    def _scatter(self, buf, inp, code, src):
        naive.scatter(self.transport, buf, inp, code, src)

    def _all_to_all(self, out, inp, code, even):
        naive.all_to_all(self.transport, out, inp, code)

    def destroy(self):
        """Release the group's threads; any later call on it raises instead of talking
        to peers that may have left (as torch.distributed refuses a destroyed group)."""
        self._destroyed = True
        self._lanes.shutdown(wait_s=self.lane_stop_seconds)
