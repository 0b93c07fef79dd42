"""A worker's connection to the parameter servers.

    ps = pt.ps.connect()                                   # in a worker started by `paratrain run --servers S`
    ps.register(model, optimizer="adam", lr=1e-3, consistency="bsp")
    for x, y in loader:
        ps.pull(model); loss_fn(model(x), y).backward(); ps.push(model); ps.clock()
    ps.close()

One ZeroMQ DEALER socket per server. Every pull and push goes to all servers
at once and the replies are collected as they come (a server may answer a
deferred pull after a later request), so a worker talks to all servers in
parallel. Tensors travel as raw bytes straight from the parameter and gradient
memory (wire.py: a fixed header, a msgpack dict, the bytes; nothing pickled).
The placement of parameters on servers (sharding.py) is computed by every
worker alike from the model, and printed by worker 0. Embedding tables
(embedding.py) are not placed: row r of a table lives on server r % S.
Requests, replies and reconnections: requests.py.
"""
import atexit
import os

import numpy as np
import torch

from .. import config, trace
from ..comm.errors import CommTimeout
from . import push_codecs, shared, sharding, wire
from .consistency import effective_mode, valid_staleness
from .requests import PSError, Requests
from .wire import Op

CONSISTENCY = ("bsp", "asp", "ssp")
CLOSE_TIMEOUT = 10.0  # seconds close() waits for the servers' goodbyes


class Client(Requests):
    def __init__(self, addrs, worker, workers, token=None, timeout=300.0):
        self.worker, self.workers, self.timeout = worker, workers, timeout
        self.token = wire.token_digest(token) if isinstance(token, str) else (token or wire.token_digest(None))
        self._connect(addrs)
        self.clock_value = 0
        self.params = None
        self.placement = None
        self.codec = None       # push_codecs.PushCodec when pushes are compressed
        self.tables = []        # the model's pt.ps.Embedding modules, in registration order
        self.offsets = {}       # (key, lo) -> the piece's place in its server's regions
        self._closed = self._left = False
        atexit.register(self.close)

    # ---- the same-host path -------------------------------------------------------------

    def _send_shared(self, server, op, step=False, exact=False, ring=False):
        """A push or pull of every piece this worker has on ``server``, through the
        server's shared segment (shared.py): one header, no payload. ``step``: a push
        that also clocks and pulls the next clock's weights (step()); ``ring``: send
        it on the server's doorbell (doorbell.py) if it has one, not ZeroMQ (which
        still carries it again if the server restarts meanwhile)."""
        def build():
            r = self.regions[server]
            if op == Op.PUSH:   # the gradients into this worker's push region first
                for pc in self.placement[server]:
                    np.copyto(r.push(self.worker, self.offsets[(pc.key, pc.lo)], pc.hi - pc.lo), self._grad(pc))
                    self.bytes_sent += (pc.hi - pc.lo) * 4   # moved through shared memory, but moved
            h = wire.Header(op=op, worker=self.worker, key=-1, clock=self.clock_value, token=self.token,
                            flags=shared.FLAG_SHM | (shared.FLAG_STEP if step else 0))
            return wire.encode(h, {"shm": r.name, **({"exact": True} if exact else {})})
        bells = self.bells[server] if ring and not self.via_zmq[server] else None
        if bells is None:
            self._track(server, op, -1, 0, build(), build)
            return (server, int(op), -1, 0)
        frames = build()
        self.rings += 1
        flags = shared.FLAG_SHM | (shared.FLAG_STEP if step else 0) | (shared.FLAG_EXACT if exact else 0)
        try:
            bells.ring(int(op), flags, self.clock_value, self.rings)
        except OSError:   # nobody reads the bell (EPIPE: the server died) or it is full: by ZeroMQ,
            self._track(server, op, -1, 0, frames, build)   # whose error reply names a new server's segment
            return (server, int(op), -1, 0)
        self.outstanding[(server, int(op), -1, 0)] = [frames, True, build]
        self.rung[bells.fileno()] = (server, int(op), self.rings)
        return (server, int(op), -1, 0)

    def _grad(self, pc):
        p = self.params[pc.key]
        if p.grad is None:
            return np.zeros(pc.hi - pc.lo, np.float32)
        return self._flat(pc.key, grad=True)[pc.lo:pc.hi]

    # ---- the API ------------------------------------------------------------------------------

    def register(self, model, optimizer="sgd", consistency="bsp", staleness=None, predict=False, compression=None,
                 **hyper):
        """Place the model's parameters on the servers and start them from worker 0's values.
        Every worker calls it with the same model. optimizer: sgd, adagrad or adam, with its
        hyper-parameters (lr=..., momentum=...); the state lives on the servers. The model's
        ``pt.ps.Embedding`` tables are registered too; their rows live only on the servers.
        predict (ASP/SSP): pulls return the weights each worker's push will most likely
        meet, extrapolated along the last update (and a momentum step further, as
        Nesterov's method looks ahead), and the servers damp each pushed gradient
        element by how far the prediction missed (ps/shard.py); pull(exact=True) does not.
        compression: how pushes travel, "topk:0.01", "onebit", "fp16" or "bf16" (push_codecs.py;
        over TCP even to a server on this host), or None."""
        from .embedding import Embedding
        if consistency not in CONSISTENCY:
            raise ValueError(f"consistency must be one of {', '.join(CONSISTENCY)}, not {consistency!r}")
        if consistency == "ssp" and not valid_staleness(staleness):
            raise ValueError(f"consistency='ssp' needs staleness: an int >= 0 (0 behaves like BSP) or math.inf "
                             f"(behaves like ASP), not {staleness!r}")
        self.codec = None if compression in (None, "none") else push_codecs.PushCodec(compression)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for n, p in named:
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {n} is {p.dtype}; the parameter server keeps float32 parameters")
        self.params = [p for _, p in named]
        consistency, staleness = effective_mode(consistency, staleness)
        self.mode = consistency
        self.tables = [m for m in model.modules() if isinstance(m, Embedding)]
        for key, table in enumerate(self.tables):
            table.attach(self, key)
        pieces = sharding.place([(n, p.numel()) for n, p in named], len(self.socks))
        self.placement = sharding.by_server(pieces, len(self.socks))
        if self.worker == 0:
            print(sharding.describe(pieces, len(self.socks)), flush=True)
            for key, t in enumerate(self.tables):
                print(f"embedding table {key}: {t.num_embeddings} x {t.embedding_dim}, row r on server "
                      f"r % {len(self.socks)}, rows created when first touched", flush=True)
        meta = {"workers": self.workers, "mode": consistency, "staleness": staleness, "optimizer": optimizer,
                "hyper": hyper, "servers": len(self.socks), "tables": [t.spec() for t in self.tables],
                "predict": bool(predict)}
        requests = []
        for s, mine in enumerate(self.placement):
            payload = None
            if self.worker == 0:
                payload = np.concatenate([self._flat(pc.key)[pc.lo:pc.hi] for pc in mine]) if mine else \
                    np.zeros(0, np.float32)
            requests.append((s, Op.REGISTER, -1, 0, 0, dict(meta, pieces=[[pc.key, pc.lo, pc.hi] for pc in mine]),
                             payload))
            at = 0
            for pc in mine:   # the server lays its shards out in this order (server.initialise)
                self.offsets[(pc.key, pc.lo)] = at
                at += pc.hi - pc.lo
        if self.codec is not None:
            self.codec.prepare([[pc.hi - pc.lo for pc in mine] for mine in self.placement])
        got = self._request(requests, "register")
        for (s, *_), (_, reply, _) in got.items():
            self._map_shared(s, reply.get("shm"))

    def _flat(self, key, grad=False):
        t = self.params[key].grad if grad else self.params[key].detach()
        return t.reshape(-1).numpy()

    def _check_registered(self):
        if self.placement is None:
            raise RuntimeError("register(model, ...) first: the servers do not know this model yet")

    def pull(self, model=None, exact=False):
        """Copy the servers' current weights into the model (waits as the consistency model says).
        Embedding rows are not pulled here but by each forward, for its batch's rows.
        exact: the weights as they are, even when registered with predict=True."""
        with trace.span("ps.pull", "comm", track="comm ps", clock=self.clock_value):
            self._check_registered()
            expected = set()
            for s, mine in enumerate(self.placement):
                if self.regions[s] is not None and mine:
                    expected.add(self._send_shared(s, Op.PULL, exact=exact, ring=True))
                    continue
                for pc in mine:
                    self._send(s, Op.PULL, pc.key, pc.lo, pc.hi, {"exact": True} if exact else None)
                    expected.add((s, int(Op.PULL), pc.key, pc.lo))
            self._copy_in(self._collect(expected, "pull"))

    def _copy_in(self, got):
        """The weights of pull replies into the parameters: from the payload, or for a
        request through the shared segment, every piece from this worker's pull region."""
        with torch.no_grad():
            for (s, op, key, lo), (h, _, payload) in got.items():
                if op not in (Op.PULL, Op.PUSH):
                    continue
                if key >= 0:
                    if op == Op.PULL:
                        self._flat(key)[lo:h.hi] = np.frombuffer(payload, dtype=np.float32)
                    continue
                r = self.regions[s]
                for pc in self.placement[s]:
                    n = pc.hi - pc.lo
                    at = self.offsets[(pc.key, pc.lo)]
                    self._flat(pc.key)[pc.lo:pc.hi] = r.values(at, n) if self.mode == "bsp" else r.pull(self.worker, at, n)
                    self.bytes_received += n * 4

    def step(self, model=None):
        """``push(); clock(); pull()`` as one request per server where every server shares
        this host (shared.py): the reply is the next clock's weights, sent when the
        consistency model allows. Elsewhere it is exactly those three calls."""
        with trace.span("ps.step", "comm", track="comm ps", clock=self.clock_value):
            self._check_registered()
            everywhere_shared = all(r is not None and mine for r, mine in zip(self.regions, self.placement))
            if self.codec is not None or not everywhere_shared:
                self.push()
                self.clock()
                return self.pull()
            expected = self._push_table_rows()   # rows first: one connection delivers in order, so before the clock
            ring = not expected   # (rung steps could overtake rows still on their way through ZeroMQ)
            for s in range(len(self.socks)):
                expected.add(self._send_shared(s, Op.PUSH, step=True, ring=ring))
            got = self._collect(expected, "step")
            self.clock_value += 1
            self._copy_in(got)

    def push(self, model=None):
        """Send this worker's gradients (parameters without a gradient send zeros), and the
        gradients of the embedding rows its forwards used since the last push."""
        with trace.span("ps.push", "comm", track="comm ps", clock=self.clock_value):
            self._check_registered()
            expected = set()
            for s, mine in enumerate(self.placement):
                if self.regions[s] is not None and mine and self.codec is None:
                    expected.add(self._send_shared(s, Op.PUSH, ring=True))
                    continue
                if self.codec is not None and mine:   # every piece in one message (push_codecs.py)
                    grad = np.concatenate([self._grad(pc) for pc in mine])
                    packed, code, meta, payload = self.codec.encode(s, grad)
                    op = Op.PUSH_PACKED if packed else Op.PUSH
                    self._send(s, op, -1, 0, grad.size, meta, payload, dtype_code=code)
                    expected.add((s, int(op), -1, 0))
                    continue
                for pc in mine:
                    self._send(s, Op.PUSH, pc.key, pc.lo, pc.hi, None, np.ascontiguousarray(self._grad(pc)))
                    expected.add((s, int(Op.PUSH), pc.key, pc.lo))
            self._collect(expected | self._push_table_rows(), "push")

    def _push_table_rows(self):
        """Send every embedding table's row gradients since the last push (to every server,
        with no rows where it touched none, so a BSP round knows this worker is done with
        it); returns the requests to wait for."""
        expected = set()
        for table in self.tables:
            rows, grads = table.take_gradients()
            for server, op, key, lo, hi, meta, payload in self._row_requests(Op.PUSH_ROWS, table.key, rows, grads):
                self._send(server, op, key, lo, hi, meta, payload)
                expected.add((server, int(op), key, lo))
        return expected

    def _row_requests(self, op, key, rows, grads=None):
        S = len(self.socks)
        owner = rows % S
        out = []
        for s in range(S):
            mine = owner == s
            payload = np.ascontiguousarray(grads[mine]) if grads is not None else None
            if op == Op.PULL_ROWS and not mine.any():
                continue
            out.append((s, op, key, 0, 0, wire.rows_meta(rows[mine]), payload))
        return out

    def pull_rows(self, key, rows):
        """The current values of ``rows`` (unique int64 ids) of embedding table ``key``, as
        a (len(rows), dim) float32 array; waits as the consistency model says."""
        self._check_registered()
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        dim = self.tables[key].embedding_dim
        out = np.empty((rows.size, dim), dtype=np.float32)
        owner = rows % len(self.socks)
        got = self._request(self._row_requests(Op.PULL_ROWS, key, rows), "pull of embedding rows")
        for (s, *_), (h, _, payload) in got.items():
            mine = owner == s
            values = np.frombuffer(payload, dtype=np.float32)
            if values.size != mine.sum() * dim:
                raise PSError(f"server {s} answered {values.size} values for {mine.sum()} rows of width {dim}")
            out[mine] = values.reshape(-1, dim)
        return out

    def push_rows(self, key, rows, grads):
        """Push gradients for ``rows`` of table ``key`` directly (the Embedding module does
        this for you in push()); repeated rows are summed on the server."""
        self._check_registered()
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        grads = np.ascontiguousarray(grads, dtype=np.float32).reshape(rows.size, -1)
        self._request(self._row_requests(Op.PUSH_ROWS, key, rows, grads), "push of embedding rows")

    def clock(self):
        """This worker finished a step: tell every server (no reply is awaited). Rung on
        the doorbell where the requests that follow will be, so none overtakes it."""
        with trace.span("ps.clock", "comm", track="comm ps", clock=self.clock_value):
            for s in range(len(self.socks)):
                if not self._ring_clock(s):
                    self._send(s, Op.CLOCK, reply=False)
            self.clock_value += 1
            return self.clock_value

    def _ring_clock(self, server):
        if self.bells[server] is None or self.via_zmq[server]:
            return False
        try:
            self.bells[server].ring(int(Op.CLOCK), 0, self.clock_value, 0)
            return True
        except OSError:
            return False

    def stats(self, server=0):
        """The server's statistics: the staleness histogram of reads, the clock log,
        rounds applied, embedding rows stored and pushed."""
        (_, meta, _), = self._request([(server, Op.STATS, -1, 0, 0, None, None)], "stats").values()
        return meta

    def leave(self, timeout=CLOSE_TIMEOUT):
        """Tell the servers this worker takes no more steps (so it no longer holds the
        others back, and BSP rounds stop waiting for it), but stay connected to read
        weights and rows, e.g. for a final evaluation. Returns True if all servers
        acknowledged."""
        if self._left:
            return True
        try:
            self._request([(s, Op.SHUTDOWN, -1, 0, 0, None, None) for s in range(len(self.socks))], "leave",
                          timeout)
            self._left = True
        except (CommTimeout, PSError):
            return False
        return True

    def _goodbye(self, what, timeout):
        try:
            return self.leave(timeout)
        finally:
            self._closed = True
            for b in self.bells:
                if b is not None:
                    b.close()
            for s in self.socks:
                s.disable_monitor()
                s.close(linger=0)
            for m in self.monitors:
                m.close(linger=0)
            self.ctx.term()

    def close(self):
        """Tell the servers this worker is done (in SSP/ASP it no longer holds others back).
        Bounded by CLOSE_TIMEOUT: this also runs at exit, when the servers may be gone."""
        if not self._closed:
            self._goodbye("close", CLOSE_TIMEOUT)


def connect(timeout=None):
    """Connect to the servers ``paratrain run --servers S`` started (PARATRAIN_PS_ADDRS)."""
    addrs = config.get("PARATRAIN_PS_ADDRS")
    if not addrs:
        raise RuntimeError("no parameter servers: start the job with `paratrain run --servers S -n N script.py` "
                           "(PARATRAIN_PS_ADDRS is not set)")
    worker = int(os.environ.get("RANK", 0))
    workers = int(os.environ.get("WORLD_SIZE", 1))
    timeout = config.get("PARATRAIN_TIMEOUT") if timeout is None else timeout
    trace.start_from_env("rank", worker)
    return Client(addrs.split(","), worker, workers, wire.token_from_env(), timeout)


def farewell(addrs, worker, workers, timeout=CLOSE_TIMEOUT):
    """Tell the servers at ``addrs`` that ``worker`` has left the job, on its behalf
    (the launcher calls this when a worker dies in an ASP/SSP job, so the slowest
    clock no longer counts a worker that will never clock again). Returns True
    when every server acknowledged within ``timeout`` seconds."""
    return Client(addrs, worker, workers, wire.token_from_env(), timeout)._goodbye("farewell", timeout)
