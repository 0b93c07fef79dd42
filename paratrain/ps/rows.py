"""The server's part of a sparse embedding table: only the rows workers touched.

A recommendation model's embedding table can be far larger than what any step
uses: with ids drawn from a Zipf law, a batch touches a few hundred of a
million rows. So the table is not allocated up front. Server ``index`` of S
owns the rows ``r`` with ``r % S == index`` (hashing by id spreads the hot
rows of a skewed distribution over every server, where ranges would put
them all on server 0), keeps them in an arena that grows by doubling, and
creates a row the first time anyone pulls or pushes it, with values that
depend only on (seed, table, row): so the same table comes out whatever the
number of servers or the order of requests, and a worker can compute the
initial value of any row itself (``initial_rows``) to check the servers.

This is the parameter server's original use case (Li et al., OSDI 2014,
sec. 2: "each worker only computes and communicates the parameters that
appear in its data", with billions of sparse features) and the way
production recommenders keep embeddings (Zhao et al., "Distributed
Hierarchical GPU Parameter Server for Massive Scale Deep Learning Ads
Systems", MLSys 2020).

The optimizer steps only the touched rows (optimizers.py ``step_rows``, as
torch's sparse optimizers), once per update, with the arena as its ``(R, D)``
view; its state grows with the arena.
"""
import numpy as np

from .optimizers import make_optimizer

F32 = np.float32
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x):
    """Steele, Lea and Flood, "Fast Splittable Pseudorandom Number Generators",
    OOPSLA 2014: a bijective mixer, so distinct counters give independent-looking
    64-bit outputs. Vectorised over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        return _mix(x + _GOLDEN)


def _mix(z):
    """splitmix64's finaliser, in place on a uint64 array (a new array would cost more
    than the arithmetic: the generator is bound by memory traffic)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def initial_rows(seed, table, rows, dim, std):
    """The initial values of ``rows`` of table ``table``: N(0, std^2) per element,
    from a counter-based generator keyed by (seed, table, row, column), so any
    row can be created alone, on any server, in any order. Box-Muller over two
    53-bit uniforms; returns a (len(rows), dim) float32 array. Computed in place,
    in the order of std * sqrt(-2 ln u1) * cos(2 pi u2), so every value is the same
    bits wherever it is made."""
    rows = np.asarray(rows, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        base = _splitmix64(np.uint64(seed & (2**64 - 1)) ^ _splitmix64(np.uint64(table)))
        counter = rows[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
        counter *= np.uint64(2)
        counter += base + _GOLDEN        # splitmix64(base + counter), its first step
        a = _mix(counter.copy())
        counter += np.uint64(1)
        b = _mix(counter)                # splitmix64(base + counter + 1)
    a >>= np.uint64(11)
    b >>= np.uint64(11)
    u1 = a.astype(np.float64)
    u1 += 1.0
    u1 /= 2.0**53                        # (0, 1]
    u2 = b.astype(np.float64)
    u2 /= 2.0**53                        # [0, 1)
    u2 *= 2.0 * np.pi
    np.log(u1, out=u1)
    u1 *= -2.0
    np.sqrt(u1, out=u1)
    u1 *= std
    u1 *= np.cos(u2, out=u2)
    return u1.astype(F32)


class RowTable:
    """Server ``index`` of ``servers``'s rows of embedding table ``key``
    (``num`` rows of ``dim`` floats), created lazily."""

    def __init__(self, key, num, dim, seed, std, index, servers, optimizer):
        if num < 1 or dim < 1:
            raise ValueError(f"an embedding table needs num >= 1 rows of dim >= 1, got {num} x {dim}")
        self.key, self.num, self.dim, self.seed, self.std = key, num, dim, seed, std
        self.index, self.servers = index, servers
        self.opt = optimizer
        owned = len(range(index, num, servers))
        self.slot_of = np.full(owned, -1, dtype=np.int64)   # local row (r // S) -> slot in the arena, or -1
        self.ids = np.zeros(0, dtype=np.int64)              # slot -> global row id
        self.values = np.zeros((0, dim), dtype=F32)         # the arena; rows [0, used) are live
        self.used = 0
        self.applied = 0        # BSP: clocks whose aggregated update has been applied
        self.pending = []       # BSP: (rows, grads) pushed for clock ``applied``
        self.pushed = set()     # BSP: workers whose push for clock ``applied`` is in ``pending``
        self.rows_pushed = 0    # rows received in pushes (for stats: exactly the touched rows)

    # ---- lookup ----------------------------------------------------------------------------

    def check_rows(self, rows):
        """``rows`` as int64, after checking each is a row of this table that this server owns."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size:
            lo, hi = int(rows.min()), int(rows.max())
            if lo < 0 or hi >= self.num:
                raise ValueError(f"row ids of table {self.key} must lie in [0, {self.num}), got [{lo}, {hi}]")
            if np.any(rows % self.servers != self.index):
                raise ValueError(f"this server ({self.index} of {self.servers}) owns rows r with r % "
                                 f"{self.servers} == {self.index} of table {self.key}; others were sent here")
        return rows

    def slots(self, rows):
        """The arena slots of ``rows`` (checked, owned), creating the missing rows."""
        rows = self.check_rows(rows)
        local = rows // self.servers
        slot = self.slot_of[local]
        new = slot < 0
        if new.any():
            fresh = np.unique(rows[new])   # a batch may name a new row more than once
            self._grow(self.used + fresh.size)
            at = np.arange(self.used, self.used + fresh.size)
            self.values[at] = initial_rows(self.seed, self.key, fresh, self.dim, self.std)
            self.ids[at] = fresh
            self.slot_of[fresh // self.servers] = at
            self.used += fresh.size
            slot = self.slot_of[local]
        return slot

    def _grow(self, need):
        """Double the arena (and the optimizer's state with it) until ``need`` rows fit."""
        cap = self.values.shape[0]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 1024)
        values = np.zeros((new_cap, self.dim), dtype=F32)
        values[:cap] = self.values
        ids = np.zeros(new_cap, dtype=np.int64)
        ids[:cap] = self.ids
        self.values, self.ids = values, ids
        self.opt.resize(new_cap * self.dim)

    # ---- requests ------------------------------------------------------------------------------

    def read(self, rows):
        """A copy of the rows' current values, (len(rows), dim)."""
        slot = self.slots(rows)   # first: creating rows may grow (replace) the arena
        return self.values[slot]

    def apply(self, rows, grads, scale=1.0, lr_scale=1.0):
        """One optimizer update of the table from the gradients of ``rows`` (repeats
        are summed first, since the update is not linear), times ``scale`` (BSP's
        average), with the learning rate times ``lr_scale`` (ASP/SSP; server.py)."""
        grads = np.asarray(grads, dtype=F32).reshape(-1, self.dim)
        slot = self.slots(rows)
        uniq, inverse = np.unique(slot, return_inverse=True)
        summed = np.zeros((uniq.size, self.dim), dtype=F32)
        np.add.at(summed, inverse, grads)
        if scale != 1.0:
            summed *= F32(scale)
        self.opt.step_lr_scaled(self.values, summed, lr_scale, rows=uniq)

    def gather(self, worker, rows, grads):
        """BSP: keep this worker's gradient for the round being gathered."""
        self.pending.append((np.asarray(rows, dtype=np.int64).copy(), np.array(grads, dtype=F32)))
        self.pushed.add(worker)

    def apply_round(self):
        """BSP: apply the round's gradients, averaged over the workers that pushed, as
        one update (every worker pushes each clock, with no rows if it touched none)."""
        rows = np.concatenate([r for r, _ in self.pending])
        grads = np.concatenate([g.reshape(-1, self.dim) for _, g in self.pending])
        self.apply(rows, grads, scale=1.0 / len(self.pushed))
        self.clear_round()
        self.applied += 1

    def clear_round(self):
        self.pending.clear()
        self.pushed.clear()

    # ---- checkpoints --------------------------------------------------------------------------------

    def state(self):
        """(arrays, meta) for a checkpoint: only the live rows, and the optimizer's state for them."""
        n = self.used
        opt = self.opt.state_dict()
        arrays = {"ids": self.ids[:n].copy(), "values": self.values[:n].copy()}
        meta = {"applied": self.applied, "rows_pushed": self.rows_pushed, "opt": {}}
        for k, v in opt.items():
            if isinstance(v, np.ndarray):
                arrays["opt." + k] = v.reshape(-1, self.dim)[:n].copy()
            else:
                meta["opt"][k] = v
        return arrays, meta

    def load(self, arrays, meta):
        ids = np.asarray(arrays["ids"], dtype=np.int64)
        self.check_rows(ids)
        n = ids.size
        self.slot_of[:] = -1
        self.values = np.zeros((0, self.dim), dtype=F32)
        self.ids = np.zeros(0, dtype=np.int64)
        self.used = 0
        self.opt.load_state_dict(dict(meta["opt"], **{k[4:]: arrays[k] for k in arrays if k.startswith("opt.")}))
        self._grow(n)
        self.values[:n] = arrays["values"]
        self.ids[:n] = ids
        self.slot_of[ids // self.servers] = np.arange(n)
        self.used = n
        self.applied = int(meta["applied"])
        self.rows_pushed = int(meta.get("rows_pushed", 0))


def make_table(key, spec, index, servers, optimizer, hyper):
    """A RowTable from a registration's table spec {"num", "dim", "seed", "std"}."""
    return RowTable(key, int(spec["num"]), int(spec["dim"]), int(spec["seed"]), float(spec["std"]), index, servers,
                    make_optimizer(optimizer, **hyper))
