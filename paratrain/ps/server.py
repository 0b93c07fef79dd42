"""One parameter server: it owns some shards of the parameters, applies the
workers' gradients to them with its own optimizer state, and answers pulls.

    python -m paratrain.ps.server        (started by ``paratrain run --servers S``)

A single-threaded loop over a ZeroMQ ROUTER socket (as ps-lite's servers,
Li et al., "Scaling Distributed Machine Learning with the Parameter Server",
OSDI 2014): every request is handled to the end before the next, so no
locks. A request that may not be answered yet (a pull that would read weights
staler than the consistency model allows, a registration before worker 0's
initial values) is *deferred*: kept with its sender's identity and answered
when a later push or clock makes it ready, or with an error naming the
workers it waited for when the deadline passes (a dead worker in BSP is
reported, not waited for forever).

Consistency (consistency.py; Ho et al., NIPS 2013):
- BSP: the pushes of one clock are summed per shard and applied once, as their
  average, when every active worker has pushed; a pull at clock c waits until
  clock c-1 has been applied, so every worker reads the same weights and BSP
  equals synchronous data parallelism.
- ASP / SSP: each push is applied on arrival, scaled by 1/W (so a full round of
  pushes moves plain SGD as far as one BSP step); a pull at clock c waits only
  while c is more than s clocks ahead of the slowest worker (ASP: never).
  Messages from one worker to one server arrive in order and a worker pushes
  before it clocks, so once the server has seen a worker's clock k, that
  worker's pushes of clocks < k are applied.
"""
import os
import signal
import sys
import threading
import time

import numpy as np

from ..comm.errors import FrameError
from . import wire
from .consistency import Clocks
from .optimizers import make_optimizer
from .wire import Op

POLL_MS = 100
MAX_PAYLOAD = 1 << 33


class Shard:
    """Elements [lo, hi) of parameter ``key``: the values, their optimizer, and the
    BSP accumulator of the clock being gathered."""

    def __init__(self, key, lo, hi, values, optimizer):
        self.key, self.lo, self.hi = key, lo, hi
        self.value = values
        self.opt = optimizer
        self.applied = 0      # BSP: clocks whose average has been applied
        self.sum = np.zeros_like(values)
        self.pushed = set()   # BSP: workers whose gradient for clock ``applied`` is in ``sum``


class Server:
    def __init__(self, index, bind, token=None, timeout=300.0):
        import zmq
        self.index, self.timeout = index, timeout
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
        self.clocks = None
        self.mode = None
        self.workers = 0
        self.deferred = []     # [deadline, ident, header, meta, payload]
        self.stopping = False
        self.bye = set()

    # ---- the loop ---------------------------------------------------------------

    def serve(self):
        import zmq
        if threading.current_thread() is threading.main_thread():  # (tests run a server in a thread)
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stopping:
            if poller.poll(POLL_MS):
                frames = self.sock.recv_multipart(copy=False)
                self.handle(frames[0].bytes, [f.buffer for f in frames[1:]])
            self._expire()
        self.sock.close()
        self.ctx.term()

    def handle(self, ident, frames):
        try:
            h, meta, payload = wire.decode(frames, max_payload=MAX_PAYLOAD, token=self.token)
        except FrameError as e:
            return self._error(ident, None, f"malformed message: {e}")
        try:
            handler = {Op.REGISTER: self._register, Op.PUSH: self._push, Op.PULL: self._pull,
                       Op.CLOCK: self._clock, Op.STATS: self._stats, Op.SHUTDOWN: self._shutdown}.get(h.op)
            if handler is None:
                return self._error(ident, h, f"operation {h.op!r} is not served here")
            handler(ident, h, meta, payload)
        except (ValueError, KeyError) as e:
            self._error(ident, h, str(e))

    def _reply(self, ident, h, meta=None, payload=None, key=None, lo=None, hi=None):
        head = wire.Header(op=Op.REPLY, worker=h.worker, key=h.key if key is None else key, clock=h.clock,
                           lo=h.lo if lo is None else lo, hi=h.hi if hi is None else hi,
                           dtype_code=3 if payload is not None else 0, flags=int(h.op), payload_nbytes=0,
                           token=wire.token_digest(None))
        self.sock.send_multipart([ident, *wire.encode(head, meta, payload)], copy=False)

    def _error(self, ident, h, message):
        head = wire.Header(op=Op.ERROR, worker=h.worker if h else -1, key=h.key if h else -1,
                           clock=h.clock if h else 0, lo=h.lo if h else 0, hi=h.hi if h else 0, dtype_code=0,
                           flags=int(h.op) if h else 0, payload_nbytes=0, token=wire.token_digest(None))
        self.sock.send_multipart([ident, *wire.encode(head, {"error": f"server {self.index}: {message}"})])

    # ---- requests -----------------------------------------------------------------

    def _register(self, ident, h, meta, payload):
        pieces = [tuple(int(v) for v in p) for p in meta.get("pieces", [])]
        if self.clocks is None:
            if h.worker != 0:  # worker 0's values initialise the shards: wait for them
                return self._defer(ident, h, meta, payload)
            self._initialise(meta, pieces, payload)
        elif sorted(pieces) != sorted((s.key, s.lo, s.hi) for s in self.shards.values()):
            raise ValueError(f"worker {h.worker} registered other tensors than worker 0 did: "
                             "every worker must register the same model")
        self._reply(ident, h, {"mode": self.mode, "workers": self.workers})
        self._retry()

    def _initialise(self, meta, pieces, payload):
        self.workers = int(meta["workers"])
        self.mode = meta["mode"]
        self.clocks = Clocks(self.workers, self.mode, meta.get("staleness"))
        values = np.frombuffer(payload, dtype=np.float32)
        at = 0
        for key, lo, hi in pieces:
            n = hi - lo
            if at + n > values.size:
                raise ValueError(f"registration carries {values.size} values, fewer than its pieces need")
            opt = make_optimizer(meta["optimizer"], **meta.get("hyper", {}))
            self.shards[(key, lo)] = Shard(key, lo, hi, values[at:at + n].copy(), opt)
            at += n
        print(f"{len(pieces)} shards, {values.nbytes / 1e6:.2f} MB, "
              f"{self.mode}{'' if meta.get('staleness') is None else ' s=' + str(meta['staleness'])}, "
              f"{self.workers} workers, optimizer {meta['optimizer']} {meta.get('hyper', {})}", flush=True)

    def _shard(self, h):
        if self.clocks is None:
            raise ValueError("no model is registered yet: call register() first")
        shard = self.shards.get((h.key, h.lo))
        if shard is None or shard.hi != h.hi:
            raise ValueError(f"no shard [{h.lo}, {h.hi}) of tensor {h.key} lives here")
        return shard

    def _push(self, ident, h, meta, payload):
        shard = self._shard(h)
        grad = np.frombuffer(payload, dtype=np.float32)
        if grad.size != shard.hi - shard.lo:
            raise ValueError(f"push of {grad.size} values for a shard of {shard.hi - shard.lo}")
        if self.mode == "bsp":
            if h.clock != shard.applied or h.worker in shard.pushed:
                raise ValueError(f"worker {h.worker} pushed for clock {h.clock} while the shard gathers clock "
                                 f"{shard.applied}{' (twice)' if h.worker in shard.pushed else ''}")
            shard.sum += grad
            shard.pushed.add(h.worker)
            self._apply_if_complete(shard)
        else:
            shard.opt.step(shard.value, grad / self.workers)
        self._reply(ident, h)
        self._retry()

    def _apply_if_complete(self, shard):
        """BSP: once every active worker has pushed for the clock being gathered, apply
        their average. Called after a push, and after a worker leaves (the round it
        was the last one missing from is then complete)."""
        if shard.pushed and self.clocks.aggregate_ready(shard.applied, shard.pushed):
            shard.opt.step(shard.value, shard.sum / len(shard.pushed))
            shard.sum[:] = 0
            shard.pushed.clear()
            shard.applied += 1

    def _pull_ready(self, h, shard):
        if self.mode == "bsp":
            return shard.applied >= h.clock
        return self.clocks.may_read(h.worker)

    def _pull(self, ident, h, meta, payload):
        shard = self._shard(h)
        if not self._pull_ready(h, shard):
            return self._defer(ident, h, meta, payload)
        self.clocks.record_read(h.worker)
        # A snapshot: zmq sends large frames later, from the buffer itself, and the next
        # push would change it under the send (a torn read of half-updated weights).
        self._reply(ident, h, None, shard.value.copy())

    def _clock(self, ident, h, meta, payload):
        self.clocks.advance(h.worker)
        self._retry()

    def _shutdown(self, ident, h, meta, payload):
        if self.clocks is not None:
            self.clocks.finish(h.worker)
            if self.mode == "bsp":
                for shard in self.shards.values():
                    self._apply_if_complete(shard)
            self._retry()
        self.bye.add(h.worker)
        self._reply(ident, h)

    def _stats(self, ident, h, meta, payload):
        c = self.clocks
        self._reply(ident, h, {} if c is None else {
            "histogram": {str(k): v for k, v in c.histogram().items()},
            "log": [list(e) for e in c.log], "applied": {f"{s.key}:{s.lo}": s.applied for s in self.shards.values()}})

    # ---- deferred requests --------------------------------------------------------------

    def _defer(self, ident, h, meta, payload):
        self.deferred.append([time.monotonic() + self.timeout, ident, h, meta, bytes(payload)])

    def _retry(self):
        waiting, self.deferred = self.deferred, []
        for deadline, ident, h, meta, payload in waiting:
            try:
                self.handle_deferred(ident, h, meta, payload, deadline)
            except (ValueError, KeyError) as e:
                self._error(ident, h, str(e))

    def handle_deferred(self, ident, h, meta, payload, deadline):
        before = len(self.deferred)
        if h.op == Op.REGISTER:
            self._register(ident, h, meta, payload)
        else:
            self._pull(ident, h, meta, payload)
        if len(self.deferred) > before:
            self.deferred[-1][0] = deadline  # still waiting: keep its original deadline

    def _expire(self):
        now = time.monotonic()
        late = [d for d in self.deferred if d[0] <= now]
        if not late:
            return
        self.deferred = [d for d in self.deferred if d[0] > now]
        for _, ident, h, meta, payload in late:
            if self.clocks is None:
                self._error(ident, h, f"worker 0 never registered within {self.timeout:g}s")
            else:
                slow = self.clocks.blocking_workers(h.worker)
                self._error(ident, h, f"worker {h.worker} waited {self.timeout:g}s at clock {h.clock} for "
                                      f"workers {slow} (at clocks {[self.clocks.clock_of(w) for w in slow]}); "
                                      f"in {self.mode.upper()} a missing worker holds everyone back")


def main():
    index = int(os.environ["PARATRAIN_PS_INDEX"])
    bind = os.environ["PARATRAIN_PS_BIND"]
    timeout = float(os.environ.get("PARATRAIN_TIMEOUT", 300))
    server = Server(index, bind, wire.token_from_env(), timeout)
    print(f"listening on {bind}", flush=True)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
