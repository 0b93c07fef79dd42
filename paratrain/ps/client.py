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
worker alike from the model, and printed by worker 0.
"""
import atexit
import os
import time

import numpy as np
import torch

from ..comm.errors import CommTimeout
from . import sharding, wire
from .wire import Op

CONSISTENCY = ("bsp", "asp", "ssp")
CLOSE_TIMEOUT = 10.0  # seconds close() waits for the servers' goodbyes


class PSError(RuntimeError):
    """A server refused a request; the message says which and why."""


class Client:
    def __init__(self, addrs, worker, workers, token=None, timeout=300.0):
        import zmq
        self.worker, self.workers, self.timeout = worker, workers, timeout
        self.token = wire.token_digest(token) if isinstance(token, str) else (token or wire.token_digest(None))
        self.ctx = zmq.Context()
        self.socks = []
        for a in addrs:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(a)
            self.socks.append(s)
        self.addrs = list(addrs)
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)
        self.clock_value = 0
        self.params = None
        self.placement = None
        self._closed = False
        atexit.register(self.close)

    # ---- messaging ----------------------------------------------------------------------

    def _send(self, server, op, key=-1, lo=0, hi=0, meta=None, payload=None):
        h = wire.Header(op=op, worker=self.worker, key=key, clock=self.clock_value, lo=lo, hi=hi,
                        dtype_code=3 if payload is not None else 0, flags=0, payload_nbytes=0, token=self.token)
        self.socks[server].send_multipart(wire.encode(h, meta, payload), copy=False)

    def _collect(self, expected, what, timeout=None):
        """Wait for ``expected`` replies: {(server, key, lo): ...}; returns them with their payloads."""
        got = {}
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while len(got) < len(expected):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted({k[0] for k in expected if k not in got})
                raise CommTimeout(f"worker {self.worker}: no answer to {what} from servers {missing} within "
                                  f"{timeout:g}s (are they running? raise PARATRAIN_TIMEOUT if slow)", missing)
            for sock, _ in self.poller.poll(min(left, 1.0) * 1000):
                server = self.socks.index(sock)
                frames = sock.recv_multipart(copy=False)
                h, meta, payload = wire.decode([f.buffer for f in frames], max_payload=1 << 40)
                if h.op == Op.ERROR:
                    raise PSError(meta.get("error", "unknown error"))
                got[(server, h.key, h.lo)] = (h, meta, payload)
        return got

    # ---- the API ------------------------------------------------------------------------------

    def register(self, model, optimizer="sgd", consistency="bsp", staleness=None, **hyper):
        """Place the model's parameters on the servers and start them from worker 0's values.
        Every worker calls it with the same model. optimizer: sgd, adagrad or adam, with its
        hyper-parameters (lr=..., momentum=...); the state lives on the servers."""
        if consistency not in CONSISTENCY:
            raise ValueError(f"consistency must be one of {', '.join(CONSISTENCY)}, not {consistency!r}")
        if consistency == "ssp" and (staleness is None or int(staleness) < 0):
            raise ValueError("consistency='ssp' needs staleness >= 0 (0 behaves like BSP)")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for n, p in named:
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {n} is {p.dtype}; the parameter server keeps float32 parameters")
        self.params = [p for _, p in named]
        pieces = sharding.place([(n, p.numel()) for n, p in named], len(self.socks))
        self.placement = sharding.by_server(pieces, len(self.socks))
        if self.worker == 0:
            print(sharding.describe(pieces, len(self.socks)), flush=True)
        meta = {"workers": self.workers, "mode": consistency, "staleness": staleness, "optimizer": optimizer,
                "hyper": hyper}
        expected = {}
        for s, mine in enumerate(self.placement):
            m = dict(meta, pieces=[[pc.key, pc.lo, pc.hi] for pc in mine])
            payload = None
            if self.worker == 0:
                payload = np.concatenate([self._flat(pc.key)[pc.lo:pc.hi] for pc in mine]) if mine else \
                    np.zeros(0, np.float32)
            self._send(s, Op.REGISTER, meta=m, payload=payload)
            expected[(s, -1, 0)] = True
        self._collect(expected, "register")

    def _flat(self, key, grad=False):
        t = self.params[key].grad if grad else self.params[key].detach()
        return t.reshape(-1).numpy()

    def pull(self, model=None):
        """Copy the servers' current weights into the model (waits as the consistency model says)."""
        expected = {}
        for s, mine in enumerate(self.placement):
            for pc in mine:
                self._send(s, Op.PULL, pc.key, pc.lo, pc.hi)
                expected[(s, pc.key, pc.lo)] = pc
        got = self._collect(expected, "pull")
        with torch.no_grad():
            for (s, key, lo), (h, _, payload) in got.items():
                self._flat(key)[lo:h.hi] = np.frombuffer(payload, dtype=np.float32)

    def push(self, model=None):
        """Send this worker's gradients (parameters without a gradient send zeros)."""
        expected = {}
        for s, mine in enumerate(self.placement):
            for pc in mine:
                p = self.params[pc.key]
                g = self._flat(pc.key, grad=True)[pc.lo:pc.hi] if p.grad is not None else \
                    np.zeros(pc.hi - pc.lo, np.float32)
                self._send(s, Op.PUSH, pc.key, pc.lo, pc.hi, payload=np.ascontiguousarray(g))
                expected[(s, pc.key, pc.lo)] = pc
        self._collect(expected, "push")

    def clock(self):
        """This worker finished a step: tell every server."""
        for s in range(len(self.socks)):
            self._send(s, Op.CLOCK)
        self.clock_value += 1
        return self.clock_value

    def stats(self, server=0):
        self._send(server, Op.STATS)
        (_, meta, _), = self._collect({(server, -1, 0): True}, "stats").values()
        return meta

    def close(self):
        """Tell the servers this worker is done (in SSP/ASP it no longer holds others back)."""
        if self._closed:
            return
        self._closed = True
        try:
            for s in range(len(self.socks)):
                self._send(s, Op.SHUTDOWN)
            # bounded: this also runs at exit, when the servers may be gone already
            self._collect({(s, -1, 0): True for s in range(len(self.socks))}, "close", CLOSE_TIMEOUT)
        except (CommTimeout, PSError):
            pass
        for s in self.socks:
            s.close()
        self.ctx.term()


def connect(timeout=None):
    """Connect to the servers ``paratrain run --servers S`` started (PARATRAIN_PS_ADDRS)."""
    addrs = os.environ.get("PARATRAIN_PS_ADDRS")
    if not addrs:
        raise RuntimeError("no parameter servers: start the job with `paratrain run --servers S -n N script.py` "
                           "(PARATRAIN_PS_ADDRS is not set)")
    worker = int(os.environ.get("RANK", 0))
    workers = int(os.environ.get("WORLD_SIZE", 1))
    timeout = float(os.environ.get("PARATRAIN_TIMEOUT", 300)) if timeout is None else timeout
    return Client(addrs.split(","), worker, workers, wire.token_from_env(), timeout)


def farewell(addrs, worker, workers, timeout=CLOSE_TIMEOUT):
    """Tell the servers at ``addrs`` that ``worker`` has left the job, on its behalf
    (the launcher calls this when a worker dies in an ASP/SSP job, so the slowest
    clock no longer counts a worker that will never clock again). Returns True
    when every server acknowledged within ``timeout`` seconds."""
    client = Client(addrs, worker, workers, wire.token_from_env(), timeout)
    try:
        for s in range(len(client.socks)):
            client._send(s, Op.SHUTDOWN)
        client._collect({(s, -1, 0): True for s in range(len(client.socks))}, "farewell", timeout)
        return True
    except (CommTimeout, PSError):
        return False
    finally:
        client._closed = True
        for s in client.socks:
            s.close(linger=0)
        client.ctx.term()
