"""Hierarchical all-reduce: reduce inside each host, all-reduce among host
leaders over the cross-host engine, broadcast inside each host.

This is how Horovod joins NCCL inside a node with MPI between nodes
(Sergeev & Del Balso, arXiv 1802.05799, "hierarchical allreduce"): the slow
network carries one buffer per host instead of one per rank. With H hosts of
L ranks each, shared memory inside (cost m_shm) and a ring among leaders:

    cost = T_shm_reduce(n) + 2(H-1) alpha_net + 2 (H-1)/H n beta_net + T_shm_bcast(n)

The collectives where a hierarchy buys little (all_gather, gather, scatter,
all_to_all, reduce_scatter, point-to-point) go straight over the cross-host
engine among all ranks ("flat").
"""
import os

from .. import ops
from ..errors import PeerError
from ..group import ProcessGroup, describe


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
        from ..shm.group import ShmGroup
        cross = os.environ.get("PARATRAIN_CROSS_BACKEND", "torch")
        world = len(ranks) == len(hosts)
        flat = make_group(ranks, me, "torch", timeout, world=world)
        host_list = sorted({hosts[r] for r in ranks})
        leaders = [min(r for r in ranks if hosts[r] == h) for h in host_list]
        if cross == "mpi":
            from ..mpi_backend import mpi_subgroup
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

    def _send(self, buf, code, dst, tag):
        self.flat._send(buf, code, dst, tag)

    def _recv(self, buf, code, src, tag):
        self.flat._recv(buf, code, src, tag)

    def _sendrecv(self, send_buf, dst, recv_buf, src, code, tag):
        self.flat._sendrecv(send_buf, dst, recv_buf, src, code, tag)

    def _post_send(self, buf, code, dst, tag):
        return self.flat._post_send(buf, code, dst, tag)

    def _post_recv(self, buf, code, src, tag):
        return self.flat._post_recv(buf, code, src, tag)

    def _all_reduce(self, buf, code, op):
        """Reduce to the host leader over shm, all-reduce among leaders, broadcast over shm."""
        inner = "sum" if op == "avg" else op
        _reduce(self.local, buf, code, inner, 0)
        if self.leaders is not None:
            # The leaders' engine's own default: PARATRAIN_ALGO (or algorithm=) chose this
            # whole algorithm, and "hierarchical" means nothing to the leaders' group.
            g = self.leaders
            algo = g._algorithm(g.default_algorithm(buf.nbytes), buf.nbytes)
            g._inner("all_reduce", g._all_reduce_with, algo, buf, code, inner, code=code, op=inner, numel=buf.size)
            if op == "avg":
                ops.finish_avg(buf, self.world_size, code)
        _broadcast(self.local, buf, code, 0)

    def _barrier(self):
        self.local._inner("barrier", self.local._barrier)
        if self.leaders is not None:
            self.leaders._inner("barrier", self.leaders._barrier)
        self.local._inner("barrier", self.local._barrier)

    def _broadcast(self, buf, code, src):
        src_host = self._host_of[src]
        my_host = self._host_of[self.rank]
        if my_host == src_host:
            _broadcast(self.local, buf, code, self.local.ranks.index(self.ranks[src]))
        if self.leaders is not None:
            _broadcast(self.leaders, buf, code, sorted(self._leader_of_host).index(src_host))
        if my_host != src_host:
            _broadcast(self.local, buf, code, 0)

    def _reduce(self, buf, code, op, dst):
        self._all_reduce(buf if self.rank == dst else buf.copy(), code, op)

    def _all_gather_into(self, out, buf, code):
        self.flat._all_gather_into(out, buf, code)

    def _reduce_scatter(self, out, inp, code, op):
        self.flat._reduce_scatter(out, inp, code, op)

    def _gather(self, out, buf, code, dst):
        self.flat._gather(out, buf, code, dst)

    def _scatter(self, buf, inp, code, src):
        self.flat._scatter(buf, inp, code, src)

    def _all_to_all(self, out, inp, code, even):
        self.flat._all_to_all(out, inp, code, even)

    def destroy(self):
        for g in (self.local, self.leaders, self.flat):
            if g is not None:
                g.destroy()
        super().destroy()


def _reduce(g, buf, code, op, dst):
    g._inner("reduce", g._reduce, buf, code, op, dst, code=code, op=op, numel=buf.size, root=dst)


def _broadcast(g, buf, code, src):
    g._inner("broadcast", g._broadcast, buf, code, src, code=code, numel=buf.size, root=src)
