"""A worker's requests to its servers: sent to all at once, kept until answered.

One ZeroMQ DEALER socket per server; the replies are collected as they come (a
server may answer a deferred pull after a later request). On the same host a
step may instead be rung on the server's doorbell (doorbell.py) and answered
there; everything else, errors included, comes through ZeroMQ.

A server that dies is restarted by the launcher from its checkpoint, on the
same address. ZeroMQ reconnects by itself; what it cannot know is which
requests the dead server took with it. So every request stays *outstanding*
until its reply arrives, the sockets are watched (a ZeroMQ socket monitor)
for disconnections, and on one every outstanding request to that server is
sent again once the connection is back (ZMQ_IMMEDIATE: a message is only
queued on a live connection, never left in a dead one's queue to be
delivered twice). Heartbeats (ZMQ_HEARTBEAT_*) notice a server whose host
vanished without closing the connection.
"""
import time

from ..comm.errors import CommTimeout
from . import doorbell, shared, wire
from .wire import Op

HEARTBEAT_MS = 1000   # ZMTP heartbeats: a silent connection is declared dead after HEARTBEAT_TIMEOUT_MS
HEARTBEAT_TIMEOUT_MS = 5000
RESEND_POLL = 0.05    # seconds between attempts to send requests the connection was not ready for


class PSError(RuntimeError):
    """A server refused a request; the message says which and why."""


class Requests:
    """The messaging half of Client (client.py): sockets, outstanding requests,
    the same-host segments and doorbells per server, and the byte and wait counters."""

    def _connect(self, addrs):
        import zmq
        self.ctx = zmq.Context()
        self.socks, self.monitors = [], []
        self.poller = zmq.Poller()
        for a in addrs:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 1000)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            s.connect(a)
            self.socks.append(s)
            self.monitors.append(mon)
            self.poller.register(s, zmq.POLLIN)
            self.poller.register(mon, zmq.POLLIN)
        self.addrs = list(addrs)
        self.outstanding = {}   # (server, op, key, lo) -> [frames, sent?, rebuild or None]
        self.reconnects = 0
        self.bytes_sent = self.bytes_received = 0   # tensor payload bytes, both ways (row ids included)
        self.wait_seconds = 0.0                     # time spent waiting for replies
        self.regions = [None] * len(addrs)   # shared.Regions per server on this host (the fast path), or None
        self.bells = [None] * len(addrs)     # doorbell.WorkerBells per server with bells, or None
        self.rung = {}          # answer FIFO's fd -> (server, op, sequence number) of the request rung there
        self.rings = 0          # requests rung so far (their sequence numbers)
        self.via_zmq = [False] * len(addrs)   # per server: ring nothing until a ZeroMQ reply (a reconnection)

    def _send(self, server, op, key=-1, lo=0, hi=0, meta=None, payload=None, reply=True, dtype_code=3):
        """Send a request; one that expects a ``reply`` stays outstanding until it comes.
        dtype_code: the payload's (comm.ops codes; float32 unless a compressed push)."""
        h = wire.Header(op=op, worker=self.worker, key=key, clock=self.clock_value, lo=lo, hi=hi,
                        dtype_code=dtype_code if payload is not None else 0, flags=0, payload_nbytes=0, token=self.token)
        frames = wire.encode(h, meta, payload)
        self.bytes_sent += memoryview(frames[2]).nbytes + len(meta.get("rows", b"") if meta else b"")
        if not reply:   # a clock: if the connection is down it is lost, and the next request's clock says it
            self._try_send(server, frames)
            return
        self._track(server, op, key, lo, frames)

    def _track(self, server, op, key, lo, frames, rebuild=None):
        entry = [frames, False, rebuild]
        self.outstanding[(server, int(op), key, lo)] = entry
        entry[1] = self._try_send(server, frames)

    def _map_shared(self, server, info):
        """Use the shared segment (and doorbells) ``info`` describes for ``server``,
        or none (None, or another host's): this server is then reached by TCP alone."""
        import zmq
        old = self.bells[server]
        if old is not None:
            self.poller.unregister(old.fileno())
            self.rung.pop(old.fileno(), None)
            old.close()
        self.regions[server] = shared.attach(info, self.workers)
        self.bells[server] = doorbell.open_worker(info, self.worker, self.workers) if self.regions[server] else None
        if self.bells[server] is not None:
            self.poller.register(self.bells[server].fileno(), zmq.POLLIN)

    def _try_send(self, server, frames):
        import zmq
        try:
            self.socks[server].send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:   # no live connection to this server (yet, or any more)
            return False

    def _resend(self):
        for (server, *_), entry in self.outstanding.items():
            if not entry[1]:
                entry[1] = self._try_send(server, entry[0])

    def _lost_connection(self, server):
        """A server's connection dropped: what it had not answered must be sent again."""
        from zmq.utils.monitor import recv_monitor_message
        recv_monitor_message(self.monitors[server])
        self.reconnects += 1
        self.via_zmq[server] = True   # the server knows the new connection only once it has heard on it
        for key, entry in self.outstanding.items():
            if key[0] == server:
                entry[1] = False

    def _collect(self, expected, what, timeout=None):
        """Wait for the replies to ``expected`` requests, a set of (server, op, key, lo);
        returns {(server, op, key, lo): (header, meta, payload)}."""
        got = {}
        started = time.perf_counter()
        try:
            return self._wait_for(expected, what, got, timeout)
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _wait_for(self, expected, what, got, timeout):
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while len(got) < len(expected):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted({k[0] for k in expected if k not in got})
                raise CommTimeout(f"worker {self.worker}: no answer to {what} from servers {missing} within "
                                  f"{timeout:g}s (are they running? raise PARATRAIN_TIMEOUT if slow)", missing)
            unsent = any(not e[1] for e in self.outstanding.values())
            for sock, _ in self.poller.poll(min(left, RESEND_POLL if unsent else 1.0) * 1000):
                if isinstance(sock, int):
                    self._answered(sock, got)
                    continue
                if sock in self.monitors:
                    self._lost_connection(self.monitors.index(sock))
                    continue
                server = self.socks.index(sock)
                self.via_zmq[server] = False   # (errors for rung requests reach this connection now)
                frames = sock.recv_multipart(copy=False)
                h, meta, payload = wire.decode([f.buffer for f in frames], max_payload=1 << 40)
                self.bytes_received += payload.nbytes
                request = (server, h.flags, h.key, h.lo)
                if request not in self.outstanding:
                    if h.op == Op.ERROR and h.flags == 0:   # the server could not even read the request
                        raise PSError(meta.get("error", "unknown error"))
                    continue   # the answer to a request already answered (sent twice around a reconnection)
                entry = self.outstanding[request]
                if h.op == Op.ERROR and entry[2] and meta.get("shm"):
                    # a restarted server, with a new segment: map it and send the request again
                    self._map_shared(server, meta["shm"])
                    if self.regions[server] is not None:
                        entry[0], entry[1] = entry[2](), False
                        continue
                del self.outstanding[request]
                bells = self.bells[server]
                if bells is not None and self.rung.get(bells.fileno(), (None,) * 3)[:2] == (server, h.flags):
                    del self.rung[bells.fileno()]   # (a rung request resent and answered by ZeroMQ)
                if h.op == Op.ERROR:
                    raise PSError(meta.get("error", "unknown error"))
                got[request] = (h, meta, payload)
            self._resend()
        return got

    def _answered(self, fd, got):
        """A server answered on this worker's doorbell FIFO: the request rung there is
        done (a pull's weights are in the shared segment), unless the answer is an older one's."""
        bells = next((b for b in self.bells if b is not None and b.fileno() == fd), None)
        if bells is None:   # (closed in this very poll: the server was restarted and remapped)
            return
        answered = bells.answered()   # (always read: a FIFO left readable would wake every poll)
        server, op, seq = self.rung.get(fd, (None, None, None))
        request = (server, op, -1, 0)
        if seq in answered and request in self.outstanding:
            del self.outstanding[request]
            del self.rung[fd]
            got[request] = (None, {}, None)

    def _request(self, requests, what, timeout=None):
        """Send ``requests`` [(server, op, key, lo, hi, meta, payload)] all at once, then
        wait for every reply: {(server, op, key, lo): (header, meta, payload)}."""
        for server, op, key, lo, hi, meta, payload in requests:
            self._send(server, op, key, lo, hi, meta, payload)
        return self._collect({(r[0], int(r[1]), r[2], r[3]) for r in requests}, what, timeout)
