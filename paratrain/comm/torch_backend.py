"""TorchGroup: the ProcessGroup API over torch.distributed (Gloo on CPU, NCCL on GPU).

So a job runs on the proven engines unchanged: ``pt.init(backend="torch")``.
Native torch.distributed collectives are used wherever torch has them; the
algorithms in comm/algorithms/ are available over torch's send/recv too
(``algorithm="ring"``), which is how the benchmark compares them on Gloo.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
in favour of ``all_gather_single`` / ``reduce_scatter_single``; we use the new
names where they exist and fall back to the old ones.
"""
import numpy as np
import torch.distributed as dist

from . import ops
from .group import ProcessGroup

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
              "prod": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.SUM}


class TorchGroup(ProcessGroup):
    backend = "torch"
    native_algorithms = ("native",)

    def __init__(self, rank, world_size, ranks, pg, timeout=None):
        """pg: a torch.distributed group handle (None means the default group)."""
        super().__init__(rank, world_size, ranks, timeout)
        self.pg = pg
        self.engine = dist.get_backend(pg)

    def default_algorithm(self, nbytes):
        return "native"

    def _global(self, r):
        return self.ranks[r]

    # point to point: torch uses global ranks
    def _send(self, buf, code, dst, tag):
        dist.send(ops.torch_view(buf, code), self._global(dst), group=self.pg, tag=tag)

    def _recv(self, buf, code, src, tag):
        dist.recv(ops.torch_view(buf, code), self._global(src), group=self.pg, tag=tag)

    def _sendrecv(self, send_buf, dst, recv_buf, src, code, tag):
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
        dist.all_gather([ops.torch_view(o, code) for o in out], ops.torch_view(buf, code), group=self.pg)

    def _reduce_scatter(self, out, inp, code, op):
        if self.engine == "gloo":
            # Gloo has no reduce_scatter: all-reduce a copy of the stacked input and keep our piece.
            stacked = np.concatenate(inp)
            dist.all_reduce(ops.torch_view(stacked, code), _TORCH_OPS[op], group=self.pg)
            n = out.size
            out[...] = stacked[self.rank * n:(self.rank + 1) * n]
        else:
            dist.reduce_scatter(ops.torch_view(out, code), [ops.torch_view(i, code) for i in inp], _TORCH_OPS[op], group=self.pg)
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
        super().destroy()
