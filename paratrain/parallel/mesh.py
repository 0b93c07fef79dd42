"""pt.mesh(dp=, tp=, pp=): every sub-group of a data x pipeline x tensor layout, built in one place.

    mesh = pt.mesh(dp=2, tp=2)          # 4 ranks
    model = pt.tensor.parallelize(GPT(), group=mesh["tp"], plan=pt.tensor.GPT_PLAN)
    model = pt.DataParallel(model, group=mesh["dp"])

Ranks are laid out tensor-parallel innermost, then pipeline, then data
parallel: rank = (d * pp + s) * tp + t. Consecutive ranks share a host under
the launcher, so each tensor-parallel group sits on one host, where its many
small all-reduces (two per layer, forward and backward) run on the shm
engine; pipeline neighbours come next, and data parallelism, one all-reduce
of the gradients a step, spans hosts (torchtitan's ``ParallelDims`` orders
them the same way).

Every rank must call ``mesh`` with the same sizes, at the same point (it
creates the groups, which is collective). A size of 1 gives a group of this
rank alone.
"""

DIMS = ("dp", "pp", "tp")   # outermost to innermost


class Mesh:
    def __init__(self, dp=1, pp=1, tp=1):
        from ..comm import new_group, world
        w = world()
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        for name, n in sizes.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"mesh: {name} must be a positive int, got {n!r}")
        if dp * pp * tp != w.world_size:
            raise ValueError(f"mesh: dp x pp x tp = {dp} x {pp} x {tp} = {dp * pp * tp}, but the job has "
                             f"{w.world_size} ranks; choose sizes whose product is {w.world_size}")
        self.sizes, self.rank = sizes, w.rank
        self.coords = dict(zip(DIMS, self._coords_of(w.rank)))
        self._groups = {}
        for name in DIMS:   # every rank creates every group, in the same order
            for ranks in self._all_groups(name):
                g = new_group(ranks)
                if w.rank in ranks:
                    self._groups[name] = g

    def _coords_of(self, rank):
        d, rest = divmod(rank, self.sizes["pp"] * self.sizes["tp"])
        s, t = divmod(rest, self.sizes["tp"])
        return d, s, t

    def rank_at(self, dp=0, pp=0, tp=0):
        return (dp * self.sizes["pp"] + pp) * self.sizes["tp"] + tp

    def _all_groups(self, name):
        """The rank lists of every group along ``name``, the other coordinates fixed."""
        others = [d for d in DIMS if d != name]
        out = []
        for a in range(self.sizes[others[0]]):
            for b in range(self.sizes[others[1]]):
                fixed = {others[0]: a, others[1]: b}
                out.append([self.rank_at(**fixed, **{name: i}) for i in range(self.sizes[name])])
        return out

    def __getitem__(self, name):
        if name not in self._groups:
            raise KeyError(f"mesh has no dimension {name!r}; it has {', '.join(DIMS)}")
        return self._groups[name]

    def __repr__(self):
        return (f"<Mesh dp={self.sizes['dp']} pp={self.sizes['pp']} tp={self.sizes['tp']}, rank {self.rank} at "
                f"{self.coords}>")


def mesh(dp=1, tp=1, pp=1):
    return Mesh(dp=dp, pp=pp, tp=tp)
