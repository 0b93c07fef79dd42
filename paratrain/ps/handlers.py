"""What a parameter server does with each request (the loop itself: server.py).

Consistency (consistency.py; Ho et al., NIPS 2013):
- BSP: the pushes of one clock are summed per shard and applied once, as their
  average, when every active worker has pushed; a pull at clock c waits until
  clock c-1 has been applied, so every worker reads the same weights and BSP
  equals synchronous data parallelism.
- ASP / SSP: each push is applied on arrival with the learning rate divided by
  W (so a full round of pushes moves about as far as one BSP step, for SGD
  exactly; dividing the gradient instead would be lost on Adam and Adagrad,
  which are invariant to its scale, and make each clock W full steps); a pull
  at clock c waits only while c is more than s clocks ahead of the slowest
  worker (ASP: never). SSP with s = 0 is BSP (consistency.effective_mode).
  A worker's push is answered before it clocks (or is the step that clocks),
  so once the server has seen a worker at clock k, through a clock or any
  request carrying k, that worker's pushes of clocks < k are applied.

Sparse embedding tables (rows.py) follow the same rules per table: BSP
gathers every worker's rows of a clock and applies their average once.
"""
import dataclasses
import time

import numpy as np

from .. import config
from ..trace import recorder as trace
from . import doorbell, push_codecs, shared, wire
from .consistency import Clocks, effective_mode
from .fused import FusedRounds
from .optimizers import make_optimizer
from .rows import make_table
from .shard import Shard
from .wire import Op


class Handlers:
    """The requests half of Server (server.py): registration and the shards' set-up,
    pushes, pulls, rows, clocks, leaving and statistics. Each handler answers with
    ``self._reply`` / ``self._error`` or defers with ``self._defer``."""

    def _register(self, ident, h, meta, payload):
        pieces = [tuple(int(v) for v in p) for p in meta.get("pieces", [])]
        if self.clocks is None:
            if h.worker != 0:  # worker 0's values initialise the shards: wait for them
                return self._defer(ident, h, meta, payload)
            self.initialise(meta, pieces, np.frombuffer(payload, dtype=np.float32))
            self.save()
        elif sorted(pieces) != sorted((s.key, s.lo, s.hi) for s in self.shards.values()) or \
                [dict(t) for t in meta.get("tables", [])] != [self.table_specs[k] for k in sorted(self.tables)]:
            raise ValueError(f"worker {h.worker} registered other tensors or embedding tables than worker 0 did "
                             "(or this server was restarted with another job's checkpoint): "
                             "every worker must register the same model")
        self._reply(ident, h, {"mode": self.mode, "workers": self.workers,
                               **({"shm": self._describe_shm()} if self.regions else {})})
        self._retry()

    def initialise(self, meta, pieces, values, quiet=False):
        """Set up the shards and tables from a registration (or a checkpoint)."""
        workers = int(meta["workers"])
        mode, staleness = effective_mode(meta["mode"], meta.get("staleness"))
        clocks = Clocks(workers, mode, staleness)   # validates mode and staleness
        make_optimizer(meta["optimizer"], **meta.get("hyper", {}))   # and the optimizer, before any state
        self.workers, self.mode, self.clocks = workers, mode, clocks
        self.staleness, self.optimizer, self.hyper = staleness, meta["optimizer"], meta.get("hyper", {})
        self.servers = int(meta.get("servers", 1))
        self.predict = bool(meta.get("predict")) and mode != "bsp"   # weight prediction (shard.py)
        for key, spec in enumerate(meta.get("tables", [])):
            spec = {k: spec[k] for k in ("num", "dim", "seed", "std")}
            self.tables[key] = make_table(key, spec, self.index, self.servers, self.optimizer, self.hyper)
            self.table_specs[key] = spec
        total = sum(hi - lo for _, lo, hi in pieces)
        if total > values.size:
            raise ValueError(f"registration carries {values.size} values, fewer than its pieces need")
        buffer = values[:total].copy()   # every shard's value a view of it (fused.py)
        at = 0
        for key, lo, hi in pieces:
            n = hi - lo
            opt = make_optimizer(meta["optimizer"], **meta.get("hyper", {}))
            self.shards[(key, lo)] = Shard(key, lo, hi, buffer[at:at + n], opt)
            if self.predict:
                self.shards[(key, lo)].enable_prediction(workers)
            self.offsets[(key, lo)] = at
            at += n
        if at and config.get("PARATRAIN_PS_SHM"):
            self.regions = shared.ServerRegions(self.index, self.workers, at)
            if config.get("PARATRAIN_PS_BELLS"):
                import zmq
                self.bells = doorbell.ServerBells(self.regions.name, self.workers)
                self.poller.register(self.bells.fileno(), zmq.POLLIN)
            if self.mode == "bsp":   # the shards live in the segment: pulls copy nothing here (shared.py)
                for (key, lo), shard in self.shards.items():
                    view = self.regions.values(self.offsets[(key, lo)], shard.hi - shard.lo)
                    np.copyto(view, shard.value)
                    shard.value = view
                buffer = self.regions.values(0, at)
        if len(self.shards) > 1 and not self.predict:
            self.fused = FusedRounds(self.shards.values(), buffer, meta["optimizer"], meta.get("hyper", {}))
        if quiet:
            return
        print(f"{len(pieces)} shards, {values.nbytes / 1e6:.2f} MB, "
              f"{self.mode}{'' if staleness is None else ' s=' + str(staleness)}, "
              f"{len(self.tables)} embedding tables, {self.workers} workers, "
              f"optimizer {meta['optimizer']} {meta.get('hyper', {})}"
              f"{', weight prediction' if self.predict else ''}", flush=True)

    def _check_registered(self):
        if self.clocks is None:
            raise ValueError("no model is registered yet: call register() first")

    def _shard(self, h):
        self._check_registered()
        shard = self.shards.get((h.key, h.lo))
        if shard is None or shard.hi != h.hi:
            raise ValueError(f"no shard [{h.lo}, {h.hi}) of tensor {h.key} lives here")
        return shard

    def _every_shard(self, h):
        """The shards, in the order a push of all of them (key -1) concatenates them."""
        self._check_registered()
        total = sum(shard.hi - shard.lo for shard in self.shards.values())
        if h.hi - h.lo != total:
            raise ValueError(f"a push of every shard here carries {total} entries, not {h.hi - h.lo}")
        return list(self.shards.values())

    def _table(self, h):
        self._check_registered()
        table = self.tables.get(h.key)
        if table is None:
            raise ValueError(f"no embedding table {h.key} is registered (tables: {sorted(self.tables)})")
        return table

    def _catch_up(self, h, unit, name):
        """After a restart: the first request of each worker for each shard or table
        resynchronises it (module docstring). Returns True when it is a push to drop."""
        if self.resync is None or (h.worker, name) in self.resync:
            return False
        self.resync.add((h.worker, name))
        if self.mode != "bsp":
            return False
        if h.clock > unit.applied:   # the rounds in between were applied by the dead server, after its checkpoint
            unit.clear_round()
            unit.applied = h.clock
        return h.op in (Op.PUSH, Op.PUSH_PACKED, Op.PUSH_ROWS) and (h.clock < unit.applied or h.worker in unit.pushed)

    def _check_round(self, h, unit):
        if h.clock != unit.applied or h.worker in unit.pushed:
            raise ValueError(f"worker {h.worker} pushed for clock {h.clock} while the server gathers clock "
                             f"{unit.applied}{' (twice)' if h.worker in unit.pushed else ''}")

    def _shared(self, ident, h, meta):
        """Is the request's shared segment this server's? If not (the server was
        restarted, with a new segment), the error reply names the new one."""
        if self.regions is None or meta.get("shm") != self.regions.name or not 0 <= h.worker < self.workers:
            self._error(ident, h, "this server has no shared segment of that name (it was restarted)",
                        **({"shm": self._describe_shm()} if self.regions else {}))
            return False
        if self.regions.used_by(h.worker) and self.bells:
            self.bells.unlink()   # every worker has opened them too (at registration, before any use)
        return True

    def _describe_shm(self):
        return {**self.regions.describe(), "bells": self.bells is not None}

    def _push(self, ident, h, meta, payload):
        """A gradient for one shard over TCP; or for every shard this worker has here
        (key -1: one message per server, as ps-lite batches a worker's keys per server),
        through the shared segment or, compressed, in the payload."""
        if h.flags & shared.FLAG_SHM:
            if not self._shared(ident, h, meta):
                return
            shards = list(self.shards.values())
            if not self._apply_push_as_one(h, self.regions.push(h.worker, 0, self.regions.total)):
                for shard in shards:
                    self._push_one(h, shard, self.regions.push(h.worker, self.offsets[(shard.key, shard.lo)],
                                                               shard.hi - shard.lo))
        else:   # float32, or fp16 / bf16 widened, or packed (a compressed push: push_codecs.py)
            shards = self._every_shard(h) if h.key == -1 else [self._shard(h)]
            sizes = [shard.hi - shard.lo for shard in shards]
            if h.op == Op.PUSH_PACKED:
                grad = push_codecs.decode(meta, payload, sizes)
            else:
                grad = push_codecs.widen(h.dtype_code, payload, sum(sizes))
            if h.key != -1 or not self._apply_push_as_one(h, grad):
                at = 0
                for shard, n in zip(shards, sizes):
                    self._push_one(h, shard, grad[at:at + n])
                    at += n
        if self.mode == "bsp":
            self._apply_rounds(shards)
        if h.flags & shared.FLAG_STEP and h.flags & shared.FLAG_SHM:
            # push, clock, pull in one request: the answer is the next clock's weights, sent as
            # soon as the consistency model allows (a BSP round: once every worker pushed),
            # which saves the worker a round trip and the server a message per step
            self._clock(ident, h, meta, payload)
            return self._pull(ident, dataclasses.replace(h, clock=h.clock + 1), meta, payload)
        self._reply(ident, h)
        self._retry()

    def _apply_push_as_one(self, h, grad):
        """ASP / SSP: a push of every shard here applied by one optimizer step over them all
        (fused.py), as each shard's apply_now would apply its piece; True if it was."""
        if self.mode == "bsp" or self.fused is None:
            return False
        for shard in self.shards.values():
            self._catch_up(h, shard, (shard.key, shard.lo))   # (after a restart: marks the resync; drops no push)
        return self.fused.apply_push(grad, 1.0 / self.workers)

    def _push_one(self, h, shard, grad):
        if self._catch_up(h, shard, (shard.key, shard.lo)):
            return
        if self.mode == "bsp":
            self._check_round(h, shard)
            shard.gather(h.worker, grad)
        else:
            shard.apply_now(h.worker, grad, 1.0 / self.workers)

    def _push_rows(self, ident, h, meta, payload):
        table = self._table(h)
        rows = table.check_rows(wire.rows_from_meta(meta, h, table.dim))
        grads = np.frombuffer(payload, dtype=np.float32).reshape(rows.size, table.dim)
        if not self._catch_up(h, table, ("table", h.key)):
            table.rows_pushed += rows.size
            if self.mode == "bsp":
                self._check_round(h, table)
                table.gather(h.worker, rows, grads)
                self._apply_if_complete(table)
            else:
                table.apply(rows, grads, lr_scale=1.0 / self.workers)
        self._reply(ident, h)
        self._retry()

    def _apply_rounds(self, shards):
        """BSP, after a push: every shard's round applied in one step where all are complete
        together (fused.py), else each shard's that is."""
        if self.fused is not None and self.fused.apply_if_complete(self.clocks.aggregate_ready):
            return
        for shard in shards:
            self._apply_if_complete(shard)

    def _apply_if_complete(self, unit):
        """BSP: once every active worker has pushed for the clock a shard or table
        gathers, apply their average. Called after a push, and after a worker leaves
        (the round it was the last one missing from is then complete)."""
        if unit.pushed and self.clocks.aggregate_ready(unit.applied, unit.pushed):
            unit.apply_round()

    def _ready(self, h, unit):
        if self.mode == "bsp":
            return unit.applied >= h.clock
        return self.clocks.may_read(h.worker)

    def _record_read(self, h, unit):
        lag = self.clocks.record_read(h.worker, h.clock - unit.applied if self.mode == "bsp" else None)
        if trace.ON:   # what paratrain trace reports as each worker's staleness
            now = time.perf_counter()
            trace.add("read", "ps", "reads", now, now, {"worker": h.worker, "clock": h.clock, "lag": lag})

    def _pull(self, ident, h, meta, payload):
        """One shard's weights over TCP, or every shard's into this worker's pull region."""
        via_shm = h.flags & shared.FLAG_SHM
        shards = list(self.shards.values()) if via_shm else [self._shard(h)]
        for shard in shards:
            self._catch_up(h, shard, (shard.key, shard.lo))
        if not all(self._ready(h, shard) for shard in shards):
            return self._defer(ident, h, meta, payload)
        if via_shm and not self._shared(ident, h, meta):
            return
        for shard in shards:
            self._record_read(h, shard)
        exact = bool(meta and meta.get("exact"))   # the weights as they are, never predicted (shard.py)
        if via_shm:
            if self.mode != "bsp":   # (BSP: the worker reads the values region itself)
                for shard in shards:
                    shard.read_into(h.worker, self.regions.pull(h.worker, self.offsets[(shard.key, shard.lo)],
                                                                shard.hi - shard.lo), exact)
            return self._reply(ident, h)
        # A snapshot: zmq sends large frames later, from the buffer itself, and the next
        # push would change it under the send (a torn read of half-updated weights).
        self._reply(ident, h, None, shards[0].read_into(h.worker, np.empty_like(shards[0].value), exact))

    def _pull_rows(self, ident, h, meta, payload):
        table = self._table(h)
        rows = table.check_rows(wire.rows_from_meta(meta, h))
        self._catch_up(h, table, ("table", h.key))
        if not self._ready(h, table):
            return self._defer(ident, h, meta, payload)
        self._record_read(h, table)
        self._reply(ident, h, None, table.read(rows))   # fancy indexing: already a copy

    def _clock(self, ident, h, meta, payload):
        if self.clocks.clock_of(h.worker) == h.clock:   # (after a restart, a request may have carried it ahead)
            self.clocks.advance(h.worker)
        self._retry()

    def _shutdown(self, ident, h, meta, payload):
        if self.clocks is not None and 0 <= h.worker < self.workers:
            self.clocks.finish(h.worker)
            if self.mode == "bsp":
                self._apply_rounds(list(self.shards.values()))
                for unit in self.tables.values():
                    self._apply_if_complete(unit)
            self._retry()
        self.bye.add(h.worker)
        self._reply(ident, h)

    def _stats(self, ident, h, meta, payload):
        c = self.clocks
        self._reply(ident, h, {} if c is None else {
            "histogram": {str(k): v for k, v in c.histogram().items()},
            "log": [list(e) for e in c.log], "applied": {f"{s.key}:{s.lo}": s.applied for s in self.shards.values()},
            "tables": {str(k): {"rows": t.used, "rows_pushed": t.rows_pushed, "applied": t.applied}
                       for k, t in self.tables.items()},
            "restored": self.resync is not None, "doorbell_requests": self.doorbell_requests,
            "fused_rounds": 0 if self.fused is None else self.fused.rounds})
