"""HierarchicalGroup: the backend for ranks on several hosts, made of two engines.

Not an algorithm over one group's transport but a group of groups: shared
memory (ShmGroup) among the ranks of each host, a cross-host engine (Gloo
through torch.distributed, or MPI) among one leader per host and among all
ranks, each used through its public API. Its all-reduce reduces inside each
host, all-reduces among the host leaders, and broadcasts inside each host.

This is how Horovod joins NCCL inside a node with MPI between nodes
(Sergeev & Del Balso, arXiv 1802.05799, "hierarchical allreduce"): the slow
network carries one buffer per host instead of one per rank. With H hosts of
L ranks each, shared memory inside (cost m_shm) and a ring among leaders:

    cost = T_shm_reduce(n) + 2(H-1) alpha_net + 2 (H-1)/H n beta_net + T_shm_bcast(n)

The collectives where a hierarchy buys little (all_gather, gather, scatter,
all_to_all, reduce_scatter, point-to-point) go straight over the cross-host
engine among all ranks ("flat").
"""

from .. import config
from . import ops
from .errors import PeerError
from .group import ProcessGroup, describe


class HierarchicalGroup(ProcessGroup):
    backend = "hierarchical"
    native_algorithms = ("hierarchical",)

    def __init__(self, rank, ranks, local, leaders, flat, leader_of_host, host_of, timeout=None):
        super().__init__(rank, len(ranks), ranks, timeout)
        self.local = local      # ShmGroup of the ranks on this host
        self.leaders = leaders  # group of one rank per host (None on non-leaders)
        self.flat = flat        # cross-host engine over all ranks of the group
        self._leader_of_host = leader_of_host  # host -> group rank of its leader
        self._host_of = host_of  # group rank -> host

    @classmethod
    def build(cls, ranks, me, hosts, store, key, timeout, make_group):
        """Called by every rank of the world (torch's new_group requires it)."""
        from .shm.group import ShmGroup
        cross = config.get("PARATRAIN_CROSS_BACKEND")
        world = len(ranks) == len(hosts)
        flat = make_group(ranks, me, "torch", timeout, world=world)
        host_list = sorted({hosts[r] for r in ranks})
        leaders = [min(r for r in ranks if hosts[r] == h) for h in host_list]
        if cross == "mpi":
            from .mpi_backend import mpi_subgroup
            leader_group = mpi_subgroup(leaders, me, timeout=timeout)
        else:
            leader_group = make_group(leaders, me, "torch", timeout)
        if me not in ranks:
            return None
        local_ranks = [r for r in ranks if hosts[r] == hosts[me]]
        local = ShmGroup(store, f"{key}/host{hosts[me]}", local_ranks.index(me), local_ranks, timeout)
        leader_of_host = {hosts[g]: ranks.index(g) for g in leaders}
        host_of = [hosts[r] for r in ranks]
        return cls(ranks.index(me), ranks, local, leader_group, flat, leader_of_host, host_of, timeout)

    def default_algorithm(self, nbytes):
        return "hierarchical"

    def _checked(self, desc, fn, *args):
        """As ProcessGroup's, but a peer's failure in one of the steps, whose error names
        the step (a reduce or broadcast inside the host, an all_reduce among the
        leaders), also names the call the user made."""
        try:
            super()._checked(desc, fn, *args)
        except PeerError as e:
            raise type(e)(f"{e}; in this rank's {describe(desc)} on the hierarchical backend", e.ranks) from e

    # Point to point goes over the cross-host engine, through its transport (comm/transport.py).

    def _send(self, buf, code, dst, tag):
        self.flat.transport.send(buf, code, dst, tag)

    def _recv(self, buf, code, src, tag):
        self.flat.transport.recv(buf, code, src, tag)

    def _sendrecv(self, send_buf, dst, recv_buf, src, code, tag):
        self.flat.transport.sendrecv(send_buf, dst, recv_buf, src, code, tag)

    def _post_send(self, buf, code, dst, tag):
        return self.flat.transport.isend(buf, code, dst, tag)

    def _post_recv(self, buf, code, src, tag):
        return self.flat.transport.irecv(buf, code, src, tag)

    # Collectives: each step is a collective of a sub-group, called through its public
    # API (blocking, with that group's own checks), on views of the caller's buffers.

    def _all_reduce(self, buf, code, op):
        """Reduce to the host leader over shm, all-reduce among leaders, broadcast over shm."""
        inner = "sum" if op == "avg" else op
        t = _tensor(buf, code)
        self.local.reduce(t, dst=0, op=inner)
        if self.leaders is not None:
            # The leaders' engine's own default: PARATRAIN_ALGO (or algorithm=) chose this
            # whole algorithm, and "hierarchical" means nothing to the leaders' group.
            self.leaders.all_reduce(t, op=inner, algorithm=self.leaders.default_algorithm(buf.nbytes))
            if op == "avg":
                ops.finish_avg(buf, self.world_size, code)
        self.local.broadcast(t, src=0)

    def _barrier(self):
        self.local.barrier()
        if self.leaders is not None:
            self.leaders.barrier()
        self.local.barrier()

    def _broadcast(self, buf, code, src):
        src_host = self._host_of[src]
        my_host = self._host_of[self.rank]
        t = _tensor(buf, code)
        if my_host == src_host:
            self.local.broadcast(t, src=self.local.ranks.index(self.ranks[src]))
        if self.leaders is not None:
            self.leaders.broadcast(t, src=sorted(self._leader_of_host).index(src_host))
        if my_host != src_host:
            self.local.broadcast(t, src=0)

    def _reduce(self, buf, code, op, dst):
        self._all_reduce(buf if self.rank == dst else buf.copy(), code, op)

    def _all_gather_into(self, out, buf, code):
        self.flat.all_gather(_tensors(out, code), _tensor(buf, code))

    def _reduce_scatter(self, out, inp, code, op):
        self.flat.reduce_scatter(_tensor(out, code), _tensors(inp, code), op=op)

    def _gather(self, out, buf, code, dst):
        self.flat.gather(_tensor(buf, code), _tensors(out, code) if out is not None else None, dst=dst)

    def _scatter(self, buf, inp, code, src):
        self.flat.scatter(_tensor(buf, code), _tensors(inp, code) if inp is not None else None, src=src)

    def _all_to_all(self, out, inp, code, even):
        if even:   # the pieces of two single tensors, split evenly: passed as those tensors again
            self.flat.all_to_all(_tensor(ops.span(out), code), _tensor(ops.span(inp), code))
        else:
            self.flat.all_to_all(_tensors(out, code), _tensors(inp, code))

    def destroy(self):
        for g in (self.local, self.leaders, self.flat):
            if g is not None:
                g.destroy()
        super().destroy()


def _tensor(buf, code):
    """A flat buffer as a group's public API takes it: the numpy array itself, but
    bfloat16 (a uint16 array here, numpy has no bfloat16) as a torch view of it."""
    return ops.torch_view(buf, code) if code == ops.BFLOAT16 else buf


def _tensors(pieces, code):
    return [_tensor(p, code) for p in pieces]
