"""TorchGroup: the ProcessGroup API over torch.distributed (Gloo on CPU, NCCL on GPU).

So a job runs on the proven engines unchanged: ``pt.init(backend="torch")``.
Native torch.distributed collectives are used wherever torch has them; the
algorithms in comm/algorithms/ are available over torch's send/recv too
(``algorithm="ring"``), which is how the benchmark compares them on Gloo.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
in favour of ``all_gather_single`` / ``reduce_scatter_single``; we use the new
names where they exist (and the old ones on an older torch) whenever the
pieces lie back to back in one buffer (always, when the caller passed one
tensor), and torch's list forms otherwise.

Torch tensors are handed to torch.distributed as they are: the caller's own
tensor object (a flat view of it where Gloo wants a shape the caller's lacks,
for the gathering collectives), on whatever device it lives, with no numpy
round trip, so strategy code written against ``pt`` runs over NCCL on GPUs
unchanged (torch_args.py checks and shapes them). numpy arrays, the portable
algorithms (``algorithm="ring"``) and PARATRAIN_DEBUG's point-to-point
envelopes take ProcessGroup's path over flat numpy buffers (CPU only), which
reaches the same collectives below through torch views of those buffers.

torch.distributed reports a dead or silent peer as a bare RuntimeError from
the engine ("Connection reset by peer", "Timed out waiting 3000ms for recv
operation"), naming neither the rank nor the operation. Every call here turns
it into paratrain's PeerError / CommTimeout, as the shm backend raises them:
which operation, and which rank died (a peer on this host found dead in /proc,
liveness.py) or which ranks it may be.
"""
import contextlib
import functools
import weakref

import torch
import torch.distributed as dist

from . import abandon, ops
from .errors import CommError, PeerError, first_line, peer_died, timed_out
from .group import ProcessGroup, describe
from .liveness import dead_local_peers
from .torch_args import all_tensors, even_pieces, flat, overlap, pieces_like, split_arg, tensor_arg
from .work import EngineWork


def _all_gather_single(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
              "prod": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.SUM}


class TorchGroup(ProcessGroup):
    backend = "torch"
    native_algorithms = ("native",)

    def __init__(self, rank, world_size, ranks, pg, timeout=None, procs=None):
        """pg: a torch.distributed group handle (None means the default group);
        procs: (host, pid) of every global rank, or None."""
        super().__init__(rank, world_size, ranks, timeout)
        self.pg = pg
        self.engine = dist.get_backend(pg)
        self.procs = procs
        self._pending = weakref.WeakSet()   # the EngineWorks of isend/irecv, settled at destroy()

    # ---- the engine's errors, in paratrain's terms --------------------------------

    @contextlib.contextmanager
    def _engine_errors(self, what, peer=None):
        """peer: the group rank a point-to-point operation waits for (None: all the others)."""
        try:
            yield
        except CommError:
            raise
        except RuntimeError as e:   # DistBackendError and Gloo's plain RuntimeErrors
            raise self._peer_error(what, e, peer) from e

    def _peer_error(self, what, e, peer=None):
        if abandon.reason() is not None:   # our own end was shut down: a member was declared dead
            return PeerError(f"{what} over {self.engine}: {abandon.reason()}")
        me = self.ranks[self.rank]
        peers = [r for r in self.ranks if r != me] if peer is None else [self._global(peer)]
        reason = first_line(e)
        dead = dead_local_peers(self.procs, me, peers)
        if dead:
            return peer_died([(r, self.procs[r][1]) for r in dead], me, f"{what} over {self.engine}", reason)
        if "timed out" in reason.lower() or "timeout" in reason.lower():
            return timed_out(me, self.timeout, f"{what} over {self.engine}", peers, reason, one_peer=peer is not None)
        return PeerError(f"rank {me}: {what} over {self.engine} failed; one of ranks {peers} closed its "
                         f"connection or misbehaved ({reason})", peers)

    def _checked(self, desc, fn, *args):
        with self._engine_errors(describe(desc)):
            super()._checked(desc, fn, *args)

    def default_algorithm(self, nbytes):
        return "native"

    def _global(self, r):
        return self.ranks[r]

    # ---- point to point: torch uses global ranks ---------------------------------

    def _send_call(self, tensor, dst, tag=0):
        if not self._passes(tensor):
            return super()._send_call(tensor, dst, tag)
        t, _ = tensor_arg(tensor, "send buffer")
        dst, tag = self._p2p_peer(dst, tag, "send")
        self._run(f"send-{dst}", lambda: self._send_t(t, dst, tag), False, f"send to {dst}")

    def _recv_call(self, tensor, src, tag=0):
        if not self._passes(tensor):
            return super()._recv_call(tensor, src, tag)
        t, _ = tensor_arg(tensor, "recv buffer")
        src, tag = self._p2p_peer(src, tag, "recv")
        self._check_alive(f"recv from {src}")
        self._lanes.drain(f"recv-{src}")   # after the irecvs from src already on its lane (_blocking_recv)
        self._recv_t(t, src, tag)
        return src

    def _isend_call(self, tensor, dst, tag=0):
        if not self._passes(tensor):
            return super()._isend_call(tensor, dst, tag)
        t, _ = tensor_arg(tensor, "isend buffer")
        dst, tag = self._p2p_peer(dst, tag, "isend")
        self._check_alive(f"isend to {dst}")
        return self._post(dist.isend, self._p2p_what("isend", t, "to", dst, tag), t, dst, tag)

    def _irecv_call(self, tensor, src, tag=0):
        if not self._passes(tensor):
            return super()._irecv_call(tensor, src, tag)
        t, _ = tensor_arg(tensor, "irecv buffer")
        src, tag = self._p2p_peer(src, tag, "irecv")
        self._check_alive(f"irecv from {src}")
        return self._post(dist.irecv, self._p2p_what("irecv", t, "from", src, tag), t, src, tag)

    def _passes(self, tensor):
        """A torch tensor goes to torch.distributed as it is, except behind PARATRAIN_DEBUG's
        envelopes (envelopes.py), which ProcessGroup sends over flat buffers."""
        return isinstance(tensor, torch.Tensor) and not self._envelopes

    def _send(self, buf, code, dst, tag):
        self._send_t(ops.torch_view(buf, code), dst, tag)

    def _recv(self, buf, code, src, tag):
        self._recv_t(ops.torch_view(buf, code), src, tag)

    def _send_t(self, t, dst, tag):
        with self._engine_errors(self._p2p_what("send", t, "to", dst, tag), dst):
            dist.send(t, self._global(dst), group=self.pg, tag=tag)

    def _recv_t(self, t, src, tag):
        with self._engine_errors(self._p2p_what("recv", t, "from", src, tag), src):
            dist.recv(t, self._global(src), group=self.pg, tag=tag)

    # isend/irecv are torch's own: Gloo sends only once the receiver has posted a
    # receive with that tag, so sends queued on one lane thread (the base class's
    # way) would deadlock a receiver that takes a later tag first.
    def _post_send(self, buf, code, dst, tag):
        return self._post(dist.isend, self._p2p_what("isend", buf, "to", dst, tag), ops.torch_view(buf, code),
                          dst, tag, keep=buf)

    def _post_recv(self, buf, code, src, tag):
        return self._post(dist.irecv, self._p2p_what("irecv", buf, "from", src, tag), ops.torch_view(buf, code),
                          src, tag, keep=buf)

    def _post(self, start, what, t, peer, tag, keep=None):
        """start (dist.isend or dist.irecv) on tensor t, as an EngineWork whose errors name
        the peer; t (and ``keep``, the numpy buffer t may view) stay referenced until done."""
        errors = functools.partial(self._engine_errors, peer=peer)
        with errors(what):
            handle = start(t, self._global(peer), group=self.pg, tag=tag)
        work = EngineWork(handle, what, errors, keep=(keep, t), destroyed=lambda: self._destroyed)
        self._pending.add(work)
        return work

    def _sendrecv(self, send_buf, dst, recv_buf, src, code, tag):
        with self._engine_errors(f"exchange with ranks {self._global(dst)} and {self._global(src)}"):
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, ops.torch_view(send_buf, code), self._global(dst), self.pg, tag),
                dist.P2POp(dist.irecv, ops.torch_view(recv_buf, code), self._global(src), self.pg, tag)])
            for r in reqs:
                r.wait()

    # ---- collectives on torch tensors, passed through ------------------------------
    # The same checks as ProcessGroup's (argument shapes and dtypes, the descriptor,
    # async_op on the collective lane), on the tensors themselves.

    def all_reduce(self, tensor, op="sum", async_op=False, algorithm=None):
        if not isinstance(tensor, torch.Tensor) or self._algorithm(algorithm, tensor.nbytes) is not None:
            return super().all_reduce(tensor, op, async_op, algorithm)   # numpy, or a portable algorithm
        op = ops.normalize_op(op)
        t, code = tensor_arg(tensor)
        ops.check_op_dtype(op, code)
        return self._collective("all_reduce", self._all_reduce_t, (t, op), async_op, code, op, t.numel())

    def broadcast(self, tensor, src=0, async_op=False):
        if not isinstance(tensor, torch.Tensor):
            return super().broadcast(tensor, src, async_op)
        t, code = tensor_arg(tensor)
        src = self._check_peer(src, "broadcast")
        return self._collective("broadcast", self._broadcast_t, (t, src), async_op, code, None, t.numel(), src)

    def reduce(self, tensor, dst=0, op="sum", async_op=False):
        if not isinstance(tensor, torch.Tensor):
            return super().reduce(tensor, dst, op, async_op)
        op = ops.normalize_op(op)
        t, code = tensor_arg(tensor)
        ops.check_op_dtype(op, code)
        dst = self._check_peer(dst, "reduce")
        return self._collective("reduce", self._reduce_t, (t, op, dst), async_op, code, op, t.numel(), dst)

    def all_gather(self, output, tensor, async_op=False):
        if not all_tensors(output, tensor):
            return super().all_gather(output, tensor, async_op)
        t, code = tensor_arg(tensor, "all_gather input")
        out = pieces_like(output, t, self.world_size, "all_gather output")
        return self._collective("all_gather", self._all_gather_t, (out, flat(t)), async_op, code, None, t.numel())

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        if not all_tensors(output, input):
            return super().reduce_scatter(output, input, op, async_op)
        op = ops.normalize_op(op)
        out, code = tensor_arg(output, "reduce_scatter output")
        ops.check_op_dtype(op, code)
        inp = pieces_like(input, out, self.world_size, "reduce_scatter input")
        return self._collective("reduce_scatter", self._reduce_scatter_t, (flat(out), inp, op), async_op, code, op,
                                out.numel())

    def gather(self, tensor, gather_list=None, dst=0, async_op=False):
        if not all_tensors(tensor, [] if gather_list is None else gather_list):
            return super().gather(tensor, gather_list, dst, async_op)
        t, code = tensor_arg(tensor, "gather input")
        dst = self._check_peer(dst, "gather")
        out = self._root_pieces(gather_list, t, dst, "gather: the destination rank", "gather_list")
        return self._collective("gather", self._gather_t, (out, flat(t), dst), async_op, code, None, t.numel(), dst)

    def scatter(self, tensor, scatter_list=None, src=0, async_op=False):
        if not all_tensors(tensor, [] if scatter_list is None else scatter_list):
            return super().scatter(tensor, scatter_list, src, async_op)
        t, code = tensor_arg(tensor, "scatter output")
        src = self._check_peer(src, "scatter")
        inp = self._root_pieces(scatter_list, t, src, "scatter: the source rank", "scatter_list")
        return self._collective("scatter", self._scatter_t, (flat(t), inp, src), async_op, code, None, t.numel(),
                                src)

    def all_to_all(self, output, input, async_op=False):
        if not all_tensors(output, input):
            return super().all_to_all(output, input, async_op)
        out, code = split_arg(output, self.world_size, "all_to_all output")
        inp, icode = split_arg(input, self.world_size, "all_to_all input")
        if icode != code:
            raise TypeError("all_to_all input and output dtypes differ")
        # As ProcessGroup.all_to_all: single tensors are even pieces; lists may be uneven.
        even = not isinstance(input, (list, tuple)) and not isinstance(output, (list, tuple))
        if even:
            out, inp = flat(out), flat(inp)
        return self._collective("all_to_all", self._all_to_all_t, (out, inp), async_op, code, None,
                                inp.numel() if even else 0, 0, int(even))

    def _root_pieces(self, pieces, like, root, who, name):
        """gather's or scatter's list on the root, as world_size flat tensors, checked; None elsewhere."""
        if self.rank != root:
            return None
        if pieces is None:
            raise ValueError(f"{who} must pass {name}")
        return even_pieces(pieces_like(pieces, like, self.world_size, name), self.world_size)

    def _collective(self, name, fn, args, async_op, code, op=None, numel=0, root=0, extra=0):
        desc = self._descriptor(name, code, op, numel, root, extra)
        return self._run("coll", lambda: self._checked(desc, fn, *args), async_op, name)

    # ---- the collectives, over torch.distributed ----------------------------------
    # Each takes torch tensors: the caller's own, passed through (above), or views of
    # ProcessGroup's flat numpy buffers (the _<collective> methods below them).

    def _all_reduce_t(self, t, op):
        dist.all_reduce(t, _TORCH_OPS[op], group=self.pg)
        if op == "avg":
            t.div_(self.world_size)

    def _broadcast_t(self, t, src):
        dist.broadcast(t, self._global(src), group=self.pg)

    def _reduce_t(self, t, op, dst):
        # Gloo's reduce may overwrite the input on non-root ranks; reduce a copy there.
        dist.reduce(t if self.rank == dst else t.clone(), self._global(dst), _TORCH_OPS[op], group=self.pg)
        if self.rank == dst and op == "avg":
            t.div_(self.world_size)

    def _all_gather_t(self, out, t):
        """out: one flat tensor of world_size x t.numel() elements, or a list of world_size flat tensors."""
        if isinstance(out, list) or not t.numel():   # empty: the list form
            dist.all_gather(even_pieces(out, self.world_size), t, group=self.pg)
        else:
            _all_gather_single(out, t, group=self.pg)

    def _reduce_scatter_t(self, out, inp, op):
        """inp: one flat tensor of world_size x out.numel() elements, or a list (Gloo has no
        list form: it is concatenated into one for the single form)."""
        if isinstance(inp, list):
            inp = torch.cat(inp)
        _reduce_scatter_single(out, inp, _TORCH_OPS[op], group=self.pg)
        if op == "avg":
            out.div_(self.world_size)

    def _gather_t(self, out, t, dst):
        dist.gather(t, out if self.rank == dst else None, dst=self._global(dst), group=self.pg)

    def _scatter_t(self, t, inp, src):
        dist.scatter(t, inp if self.rank == src else None, src=self._global(src), group=self.pg)

    def _all_to_all_t(self, out, inp):
        """out, inp: two flat tensors split evenly, or lists of world_size flat tensors
        (a single tensor beside a list is split into its even pieces)."""
        if not isinstance(out, list) and not isinstance(inp, list):
            if overlap(out, inp):   # in place: the engine reads what it already wrote
                inp = inp.clone()
            dist.all_to_all_single(out, inp, group=self.pg)
            return
        out, inp = even_pieces(out, self.world_size), even_pieces(inp, self.world_size)
        if self.engine == "gloo":
            # Gloo has all_to_all_single (with split sizes) but not the list form.
            send = torch.cat(inp)
            recv = torch.empty(sum(o.numel() for o in out), dtype=out[0].dtype, device=out[0].device)
            dist.all_to_all_single(recv, send, output_split_sizes=[o.numel() for o in out],
                                   input_split_sizes=[i.numel() for i in inp], group=self.pg)
            for o, r in zip(out, recv.split([o.numel() for o in out])):
                o.copy_(r)
        else:
            dist.all_to_all(out, inp, group=self.pg)

    def _barrier(self):
        dist.barrier(group=self.pg)

    # ProcessGroup's path (numpy arrays, and tensors under PARATRAIN_DEBUG's p2p checks):
    # its flat buffers as torch views, into the same collectives.

    def _all_reduce(self, buf, code, op):
        self._all_reduce_t(ops.torch_view(buf, code), op)

    def _broadcast(self, buf, code, src):
        self._broadcast_t(ops.torch_view(buf, code), src)

    def _reduce(self, buf, code, op, dst):
        self._reduce_t(ops.torch_view(buf, code), op, dst)

    def _all_gather_into(self, out, buf, code):
        flat = ops.span(out) if buf.size else None   # pieces end to end: the single form (empty: the list form)
        self._all_gather_t(_views(out, code) if flat is None else ops.torch_view(flat, code),
                           ops.torch_view(buf, code))

    def _reduce_scatter(self, out, inp, code, op):
        flat = ops.span(inp)
        self._reduce_scatter_t(ops.torch_view(out, code), _views(inp, code) if flat is None
                               else ops.torch_view(flat, code), op)

    def _gather(self, out, buf, code, dst):
        self._gather_t(_views(out, code) if self.rank == dst else None, ops.torch_view(buf, code), dst)

    def _scatter(self, buf, inp, code, src):
        self._scatter_t(ops.torch_view(buf, code), _views(inp, code) if self.rank == src else None, src)

    def _all_to_all(self, out, inp, code, even):
        self._all_to_all_t(_views(out, code), _views(inp, code))

    def destroy(self):
        """Pending isends/irecvs are settled first (EngineWork.give_up): a Gloo
        operation cannot be withdrawn, and a thread left blocked in its wait would
        outlast the destroy until the timeout."""
        self._destroyed = True
        for work in list(self._pending):
            work.give_up()
        super().destroy()


def _views(pieces, code):
    return [ops.torch_view(p, code) for p in pieces]
