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
Same-host requests (steps, dense pushes and pulls, clocks) may come rung on
the server's doorbell (doorbell.py) instead of the socket; they are handled
alike and answered on the worker's FIFO.

What each request does, and the consistency models: handlers.py.

Checkpoints (server_state.py): with PARATRAIN_PS_CHECKPOINT_DIR set, the
server saves its state there right after registration, every
PARATRAIN_PS_CHECKPOINT_SECONDS (default 30) or every
PARATRAIN_PS_CHECKPOINT_CLOCKS clocks of the slowest worker, and when it
stops cleanly; started again (by the launcher, after a crash) it loads that
file and serves on. The workers resend what the dead server never answered
(requests.py). Until every worker has been heard from again, the restarted
server *resynchronises* instead of judging: a BSP request from a clock ahead
of a shard moves the shard forward to it (the rounds in between are the lost
updates) and a push for a round already passed is acknowledged and dropped.
"""
import signal
import sys
import threading

from .. import config, trace
from ..trace import recorder as trace_recorder
from ..comm.errors import FrameError
from ..launch.heap import keep_freed_memory
from . import doorbell, server_state, shared, wire
from .handlers import Handlers
from .waiting import Waiting
from .wire import Op

POLL_MS = 100
RINGABLE = {(int(Op.PUSH), shared.FLAG_SHM | shared.FLAG_STEP), (int(Op.PUSH), shared.FLAG_SHM),
            (int(Op.PULL), shared.FLAG_SHM), (int(Op.PULL), shared.FLAG_SHM | shared.FLAG_EXACT),
            (int(Op.CLOCK), 0)}   # (a clock is never answered, rung or not)
MAX_PAYLOAD = 1 << 33


class Server(Handlers):
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
        self.fused = None      # BSP: the shards' rounds stepped as one where they complete together (fused.py)
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
        self.bells = None      # doorbell.ServerBells: same-host requests without ZeroMQ
        self.idents = {}       # worker -> its ZeroMQ identity (errors to rung requests go there)
        self.doorbell_requests = 0   # requests rung on the doorbell (all workers)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.deferred = Waiting(timeout)   # requests the consistency model holds back
        self.stopping = False
        self.bye = set()

    # ---- the loop ---------------------------------------------------------------

    def serve(self):
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
        """Requests rung on the doorbell (doorbell.py): each is the same request as one
        sent through ZeroMQ with the shared segment, answered on the worker's FIFO."""
        for worker, op, flags, clock, seq in self.bells.rung():
            meta = {"shm": self.regions.name}
            if (op, flags) not in RINGABLE:
                print(f"doorbell: worker {worker} rang op {op} with flags {flags}; dropped", flush=True)
                continue
            if flags & shared.FLAG_EXACT:
                flags, meta["exact"] = flags & ~shared.FLAG_EXACT, True
            self.doorbell_requests += 1
            h = wire.Header(op=Op(op), worker=worker, clock=clock, flags=flags)
            self._dispatch(doorbell.Rung(worker, seq), h, meta, b"")

    def _dispatch(self, ident, h, meta, payload):
        if trace_recorder.ON:
            with trace.span(getattr(h.op, "name", str(h.op)).lower(), "compute", worker=h.worker, clock=h.clock,
                            mode=self.mode):   # (a BSP round's pushes tell the merge whom it waited for)
                return self._handle(ident, h, meta, payload)
        return self._handle(ident, h, meta, payload)

    def _handle(self, ident, h, meta, payload):
        try:
            handler = {Op.REGISTER: self._register, Op.PUSH: self._push, Op.PUSH_PACKED: self._push, Op.PULL: self._pull,
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
        if isinstance(ident, doorbell.Rung):   # (a rung request's answer: no meta, no payload)
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
    index = config.require("PARATRAIN_PS_INDEX")
    bind = config.require("PARATRAIN_PS_BIND")
    trace.start_from_env("server", index)
    server = Server(index, bind, wire.token_from_env(), config.get("PARATRAIN_TIMEOUT"),
                    checkpoint_dir=config.get("PARATRAIN_PS_CHECKPOINT_DIR"),
                    checkpoint_seconds=config.get("PARATRAIN_PS_CHECKPOINT_SECONDS"),
                    checkpoint_clocks=config.get("PARATRAIN_PS_CHECKPOINT_CLOCKS"))
    restored = server.restore()
    restart = config.get("PARATRAIN_PS_RESTART")
    if restored:
        print(f"restart {restart}: restored {server.checkpoints.path} (clocks {restored['clocks']['clocks']}); "
              "updates after it are lost", flush=True)
    print(f"listening on {bind}" + (f", checkpoints in {server.checkpoints.path}" if server.checkpoints.path else ""),
          flush=True)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
