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

import numpy as np
import torch.distributed as dist

from . import ops
from .errors import CommError, PeerError, first_line, peer_died, timed_out
from .group import ProcessGroup, describe
from .liveness import dead_local_peers
from .work import EngineWork

_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

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

    # point to point: torch uses global ranks
    def _send(self, buf, code, dst, tag):
        with self._engine_errors(self._p2p_what("send", buf, "to", dst, tag), dst):
            dist.send(ops.torch_view(buf, code), self._global(dst), group=self.pg, tag=tag)

    def _recv(self, buf, code, src, tag):
        with self._engine_errors(self._p2p_what("recv", buf, "from", src, tag), src):
            dist.recv(ops.torch_view(buf, code), self._global(src), group=self.pg, tag=tag)

    # isend/irecv are torch's own: Gloo sends only once the receiver has posted a
    # receive with that tag, so sends queued on one lane thread (the base class's
    # way) would deadlock a receiver that takes a later tag first.
    def _post_send(self, buf, code, dst, tag):
        return self._post(dist.isend, self._p2p_what("isend", buf, "to", dst, tag), buf, code, dst, tag)

    def _post_recv(self, buf, code, src, tag):
        return self._post(dist.irecv, self._p2p_what("irecv", buf, "from", src, tag), buf, code, src, tag)

    def _post(self, start, what, buf, code, peer, tag):
        """start (dist.isend or dist.irecv) on buf, as an EngineWork whose errors name the peer."""
        t = ops.torch_view(buf, code)
        errors = functools.partial(self._engine_errors, peer=peer)
        with errors(what):
            handle = start(t, self._global(peer), group=self.pg, tag=tag)
        work = EngineWork(handle, what, errors, keep=(buf, t), destroyed=lambda: self._destroyed)
        self._pending.add(work)
        return work

    def _sendrecv(self, send_buf, dst, recv_buf, src, code, tag):
        with self._engine_errors(f"exchange with ranks {self._global(dst)} and {self._global(src)}"):
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, ops.torch_view(send_buf, code), self._global(dst), self.pg, tag),
                dist.P2POp(dist.irecv, ops.torch_view(recv_buf, code), self._global(src), self.pg, tag)])
            for r in reqs:
                r.wait()

    def _avg(self, buf, code, op):
        if op == "avg":
            ops.finish_avg(buf, self.world_size, code)

    def _all_reduce(self, buf, code, op):
        dist.all_reduce(ops.torch_view(buf, code), _TORCH_OPS[op], group=self.pg)
        self._avg(buf, code, op)

    def _barrier(self):
        dist.barrier(group=self.pg)

    def _broadcast(self, buf, code, src):
        dist.broadcast(ops.torch_view(buf, code), self._global(src), group=self.pg)

    def _reduce(self, buf, code, op, dst):
        # Gloo's reduce may overwrite the input on non-root ranks; reduce a copy there.
        t = ops.torch_view(buf, code) if self.rank == dst else ops.torch_view(buf.copy(), code)
        dist.reduce(t, self._global(dst), _TORCH_OPS[op], group=self.pg)
        if self.rank == dst:
            self._avg(buf, code, op)

    def _all_gather_into(self, out, buf, code):
        flat = ops.span(out) if buf.size else None   # empty: the list form
        if flat is not None:
            _ALL_GATHER_SINGLE(ops.torch_view(flat, code), ops.torch_view(buf, code), group=self.pg)
        else:
            dist.all_gather([ops.torch_view(o, code) for o in out], ops.torch_view(buf, code), group=self.pg)

    def _reduce_scatter(self, out, inp, code, op):
        flat = ops.span(inp)
        if flat is None:   # the list form, which Gloo lacks: one buffer for the single form
            flat = np.concatenate(inp)
        _REDUCE_SCATTER_SINGLE(ops.torch_view(out, code), ops.torch_view(flat, code), _TORCH_OPS[op],
                               group=self.pg)
        self._avg(out, code, op)

    def _gather(self, out, buf, code, dst):
        dist.gather(ops.torch_view(buf, code), [ops.torch_view(o, code) for o in out] if self.rank == dst else None,
                    dst=self._global(dst), group=self.pg)

    def _scatter(self, buf, inp, code, src):
        dist.scatter(ops.torch_view(buf, code), [ops.torch_view(i, code) for i in inp] if self.rank == src else None,
                     src=self._global(src), group=self.pg)

    def _all_to_all(self, out, inp, code, even):
        if self.engine == "gloo":
            # Gloo has all_to_all_single (with split sizes) but not the list form.
            send = np.concatenate(inp)
            recv = np.empty(sum(o.size for o in out), dtype=out[0].dtype)
            dist.all_to_all_single(ops.torch_view(recv, code), ops.torch_view(send, code),
                                   output_split_sizes=[o.size for o in out],
                                   input_split_sizes=[i.size for i in inp], group=self.pg)
            off = 0
            for o in out:
                o[...] = recv[off:off + o.size]
                off += o.size
        else:
            dist.all_to_all([ops.torch_view(o, code) for o in out], [ops.torch_view(i, code) for i in inp], group=self.pg)

    def destroy(self):
        """Pending isends/irecvs are settled first (EngineWork.give_up): a Gloo
        operation cannot be withdrawn, and a thread left blocked in its wait would
        outlast the destroy until the timeout."""
        self._destroyed = True
        for work in list(self._pending):
            work.give_up()
        super().destroy()
