"""One parameter server: it owns some shards of the parameters, applies the
workers' gradients to them with its own optimizer state, and answers pulls.

    python -m paratrain.ps.server        (started by ``paratrain run --servers S``)

A single-threaded loop over a ZeroMQ ROUTER socket (as ps-lite's servers,
Li et al., "Scaling Distributed Machine Learning with the Parameter Server",
OSDI 2014): every request is handled to the end before the next, so no
locks. A request that may not be answered yet (a pull that would read weights
staler than the consistency model allows, a registration before worker 0's
initial values) is *deferred* (waiting.py): answered when a later push or
clock makes it ready, or with an error naming the workers it waited for when
its deadline passes (a dead worker in BSP is reported, not waited for forever).

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
  Messages from one worker to one server arrive in order and a worker pushes
  before it clocks, so once the server has seen a worker's clock k, that
  worker's pushes of clocks < k are applied.

Sparse embedding tables (rows.py) follow the same rules per table: BSP
gathers every worker's rows of a clock and applies their average once.

Checkpoints (server_state.py): with PARATRAIN_PS_CHECKPOINT_DIR set, the
server saves its state there right after registration, every
PARATRAIN_PS_CHECKPOINT_SECONDS (default 30) or every
PARATRAIN_PS_CHECKPOINT_CLOCKS clocks of the slowest worker, and when it
stops cleanly; started again (by the launcher, after a crash) it loads that
file and serves on. The workers resend what the dead server never answered
(client.py). Until every worker has been heard from again, the restarted
server *resynchronises* instead of judging: a BSP request from a clock ahead
of a shard moves the shard forward to it (the rounds in between are the lost
updates) and a push for a round already passed is acknowledged and dropped.
"""
import dataclasses
import os
import signal
import sys
import threading
import time

import numpy as np

from ..comm.errors import FrameError
from . import doorbell, server_state, shared, wire
from .consistency import Clocks, effective_mode
from .optimizers import make_optimizer
from .memory import keep_freed_memory
from .rows import make_table
from .shard import Shard
from .waiting import Waiting
from .wire import Op

POLL_MS = 100
MAX_PAYLOAD = 1 << 33


class Server:
    def __init__(self, index, bind, token=None, timeout=300.0, checkpoint_dir=None, checkpoint_seconds=30.0,
                 checkpoint_clocks=0):
        import zmq
        self.index, self.timeout = index, timeout
        self.checkpoints = server_state.Checkpoints(checkpoint_dir, index, checkpoint_seconds, checkpoint_clocks)
        self.token = token
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        try:
            self.sock.bind(bind)
        except zmq.ZMQError as e:
            raise OSError(f"parameter server {index} cannot listen on {bind}: {e} "
                          "(is the port in use? pick other ports or let paratrain run choose)") from None
        self.shards = {}       # (key, lo) -> Shard
        self.tables = {}       # key -> RowTable (sparse embedding rows)
        self.table_specs = {}
        self.clocks = None
        self.mode = self.optimizer = self.staleness = None
        self.predict = False
        self.hyper = {}
        self.workers = 0
        self.servers = 1
        self.resync = None     # after a restart: the workers not heard from yet
        self.offsets = {}      # (key, lo) -> the shard's place in the shared regions
        self.regions = None    # shared.ServerRegions: the same-host fast path
        self.bells = None      # doorbell.ServerBells: same-host steps without ZeroMQ
        self.idents = {}       # worker -> its ZeroMQ identity (errors to a doorbell step go there)
        self.doorbell_steps = 0   # steps rung on the doorbell (all workers)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.deferred = Waiting(timeout)   # requests the consistency model holds back
        self.stopping = False
        self.bye = set()

    # ---- the loop ---------------------------------------------------------------

    def serve(self):
        import zmq
        if threading.current_thread() is threading.main_thread():  # (tests run a server in a thread)
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        while not self.stopping:
            for sock, _ in self.poller.poll(POLL_MS):
                if sock is self.sock:
                    frames = self.sock.recv_multipart(copy=False)
                    self.handle(frames[0].bytes, [f.buffer for f in frames[1:]])
                else:
                    self._rung()
            self._expire()
            self.checkpoints.maybe_save(self)
        self.save()   # (nothing to save without a checkpoint directory or a registered model)
        if self.bells:
            self.bells.close()
        self.sock.close()
        self.ctx.term()

    def handle(self, ident, frames):
        try:
            h, meta, payload = wire.decode(frames, max_payload=MAX_PAYLOAD, token=self.token)
        except FrameError as e:
            return self._error(ident, None, f"malformed message: {e}")
        if 0 <= h.worker < 1 << 16:
            self.idents[h.worker] = ident
        self._dispatch(ident, h, meta, payload)

    def _rung(self):
        """Steps rung on the doorbell (doorbell.py): each is the same request as a
        step sent through ZeroMQ with the shared segment, answered on the worker's FIFO."""
        step = shared.FLAG_SHM | shared.FLAG_STEP
        for worker, flags, clock, seq in self.bells.rung():
            if flags != step:
                print(f"doorbell: worker {worker} rang with flags {flags}, not a step; dropped", flush=True)
                continue
            h = wire.Header(op=Op.PUSH, worker=worker, clock=clock, flags=flags)
            self.doorbell_steps += 1
            self._dispatch(doorbell.Rung(worker, seq), h, {"shm": self.regions.name}, b"")

    def _dispatch(self, ident, h, meta, payload):
        try:
            handler = {Op.REGISTER: self._register, Op.PUSH: self._push, Op.PULL: self._pull,
                       Op.PUSH_ROWS: self._push_rows, Op.PULL_ROWS: self._pull_rows,
                       Op.CLOCK: self._clock, Op.STATS: self._stats, Op.SHUTDOWN: self._shutdown}.get(h.op)
            if handler is None:
                return self._error(ident, h, f"operation {h.op!r} is not served here")
            if self.clocks is not None and 0 <= h.worker < self.workers and h.op != Op.REGISTER:
                self.clocks.observe(h.worker, h.clock)
            handler(ident, h, meta, payload)
        except (ValueError, KeyError, FrameError) as e:
            self._error(ident, h, str(e))
        except Exception as e:   # a bug of ours: answer, log, and keep serving the other workers
            import traceback
            traceback.print_exc()
            self._error(ident, h, f"internal error while handling {h.op.name}: {type(e).__name__}: {e}")

    def _reply(self, ident, h, meta=None, payload=None, key=None, lo=None, hi=None):
        if isinstance(ident, doorbell.Rung):   # (a step's answer: no meta, no payload)
            return self.bells.answer(ident.worker, ident.seq)
        head = wire.Header(op=Op.REPLY, worker=h.worker, key=h.key if key is None else key, clock=h.clock,
                           lo=h.lo if lo is None else lo, hi=h.hi if hi is None else hi,
                           dtype_code=3 if payload is not None else 0, flags=int(h.op), payload_nbytes=0,
                           token=wire.token_digest(None))
        self.sock.send_multipart([ident, *wire.encode(head, meta, payload)], copy=False)

    def _error(self, ident, h, message, **extra):
        if isinstance(ident, doorbell.Rung):   # errors travel over ZeroMQ, to the worker's identity
            ident = self.idents.get(ident.worker)
            if ident is None:
                return print(f"cannot tell worker {h.worker}: {message}", flush=True)
        head = wire.Header(op=Op.ERROR, worker=h.worker if h else -1, key=h.key if h else -1,
                           clock=h.clock if h else 0, lo=h.lo if h else 0, hi=h.hi if h else 0, dtype_code=0,
                           flags=int(h.op) if h else 0, payload_nbytes=0, token=wire.token_digest(None))
        self.sock.send_multipart([ident, *wire.encode(head, {"error": f"server {self.index}: {message}", **extra})])

    # ---- requests -----------------------------------------------------------------

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
        at = 0
        for key, lo, hi in pieces:
            n = hi - lo
            if at + n > values.size:
                raise ValueError(f"registration carries {values.size} values, fewer than its pieces need")
            opt = make_optimizer(meta["optimizer"], **meta.get("hyper", {}))
            self.shards[(key, lo)] = Shard(key, lo, hi, values[at:at + n].copy(), opt)
            if self.predict:
                self.shards[(key, lo)].enable_prediction(workers)
            self.offsets[(key, lo)] = at
            at += n
        if at and os.environ.get("PARATRAIN_PS_SHM", "1") != "0":
            self.regions = shared.ServerRegions(self.index, self.workers, at)
            if os.environ.get("PARATRAIN_PS_BELLS", "1") != "0":
                import zmq
                self.bells = doorbell.ServerBells(self.regions.name, self.workers)
                self.poller.register(self.bells.fileno(), zmq.POLLIN)
            if self.mode == "bsp":   # the shards live in the segment: pulls copy nothing here (shared.py)
                for (key, lo), shard in self.shards.items():
                    view = self.regions.values(self.offsets[(key, lo)], shard.hi - shard.lo)
                    np.copyto(view, shard.value)
                    shard.value = view
        if quiet:
            return
        print(f"{len(pieces)} shards, {values.nbytes / 1e6:.2f} MB, "
              f"{self.mode}{'' if staleness is None else ' s=' + str(staleness)}, "
              f"{len(self.tables)} embedding tables, {self.workers} workers, "
              f"optimizer {meta['optimizer']} {meta.get('hyper', {})}"
              f"{', weight prediction' if self.predict else ''}", flush=True)

    def _shard(self, h):
        if self.clocks is None:
            raise ValueError("no model is registered yet: call register() first")
        shard = self.shards.get((h.key, h.lo))
        if shard is None or shard.hi != h.hi:
            raise ValueError(f"no shard [{h.lo}, {h.hi}) of tensor {h.key} lives here")
        return shard

    def _table(self, h):
        if self.clocks is None:
            raise ValueError("no model is registered yet: call register() first")
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
        return h.op in (Op.PUSH, Op.PUSH_ROWS) and (h.clock < unit.applied or h.worker in unit.pushed)

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
        """A gradient for one shard over TCP, or, through the shared segment, for every
        shard this worker has here (key -1: one message per server, as ps-lite batches
        a worker's keys per server)."""
        if h.flags & shared.FLAG_SHM:
            if not self._shared(ident, h, meta):
                return
            for shard in self.shards.values():
                self._push_one(h, shard, self.regions.push(h.worker, self.offsets[(shard.key, shard.lo)],
                                                           shard.hi - shard.lo))
        else:
            shard = self._shard(h)
            grad = np.frombuffer(payload, dtype=np.float32)
            if grad.size != shard.hi - shard.lo:
                raise ValueError(f"push of {grad.size} values for a shard of {shard.hi - shard.lo}")
            self._push_one(h, shard, grad)
        if h.flags & shared.FLAG_STEP and h.flags & shared.FLAG_SHM:
            # push, clock, pull in one request: the answer is the next clock's weights, sent as
            # soon as the consistency model allows (a BSP round: once every worker pushed),
            # which saves the worker a round trip and the server a message per step
            self._clock(ident, h, meta, payload)
            return self._pull(ident, dataclasses.replace(h, clock=h.clock + 1), meta, payload)
        self._reply(ident, h)
        self._retry()

    def _push_one(self, h, shard, grad):
        if self._catch_up(h, shard, (shard.key, shard.lo)):
            return
        if self.mode == "bsp":
            self._check_round(h, shard)
            shard.gather(h.worker, grad)
            self._apply_if_complete(shard)
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
        self.clocks.record_read(h.worker, h.clock - unit.applied if self.mode == "bsp" else None)

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
                for unit in [*self.shards.values(), *self.tables.values()]:
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
            "restored": self.resync is not None, "doorbell_steps": self.doorbell_steps})

    # ---- checkpoints ---------------------------------------------------------------------------

    def save(self):
        self.checkpoints.save(self)

    def restore(self):
        """Load this server's checkpoint, if there is one; returns its meta or None.
        The workers are then resynchronised as they are heard from (_catch_up)."""
        meta = self.checkpoints.restore(self)
        if meta is not None:
            self.resync = set()
        return meta

    # ---- deferred requests --------------------------------------------------------------

    def _defer(self, ident, h, meta, payload):
        self.deferred.add(ident, h, meta, payload)

    def _retry(self):
        """Try every waiting request again (after a push, a clock, a worker leaving)."""
        for deadline, ident, h, meta, payload in self.deferred.take():
            before = len(self.deferred)
            try:
                {Op.REGISTER: self._register, Op.PULL: self._pull, Op.PULL_ROWS: self._pull_rows,
                 Op.PUSH: self._pull}[h.op](ident, h, meta, payload)   # (a PUSH waits only as a step's pull)
            except (ValueError, KeyError) as e:
                self._error(ident, h, str(e))
            self.deferred.keep_deadline(before, deadline)

    def _expire(self):
        for _, ident, h, meta, payload in self.deferred.expired():
            if self.clocks is None:
                self._error(ident, h, f"worker 0 never registered within {self.timeout:g}s")
            else:
                slow = self.clocks.blocking_workers(h.worker)
                self._error(ident, h, f"worker {h.worker} waited {self.timeout:g}s at clock {h.clock} for "
                                      f"workers {slow} (at clocks {[self.clocks.clock_of(w) for w in slow]}); "
                                      f"in {self.mode.upper()} a missing worker holds everyone back")


def main():
    keep_freed_memory()
    index = int(os.environ["PARATRAIN_PS_INDEX"])
    bind = os.environ["PARATRAIN_PS_BIND"]
    timeout = float(os.environ.get("PARATRAIN_TIMEOUT", 300))
    server = Server(index, bind, wire.token_from_env(), timeout,
                    checkpoint_dir=os.environ.get("PARATRAIN_PS_CHECKPOINT_DIR") or None,
                    checkpoint_seconds=float(os.environ.get("PARATRAIN_PS_CHECKPOINT_SECONDS", 30)),
                    checkpoint_clocks=int(os.environ.get("PARATRAIN_PS_CHECKPOINT_CLOCKS", 0)))
    restored = server.restore()
    restart = int(os.environ.get("PARATRAIN_PS_RESTART", 0))
    if restored:
        print(f"restart {restart}: restored {server.checkpoints.path} (clocks {restored['clocks']['clocks']}); "
              "updates after it are lost", flush=True)
    print(f"listening on {bind}" + (f", checkpoints in {server.checkpoints.path}" if server.checkpoints.path else ""),
          flush=True)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
