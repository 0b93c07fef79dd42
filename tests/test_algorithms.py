"""The portable collective algorithms (comm/algorithms/: naive, ring, tree) over a fake
transport in one process: one thread per rank, messages through queues.

The fake has exactly the documented Transport interface (comm/transport.py) and
nothing else (``__slots__``), so an algorithm reaching for anything of the group
behind its transport fails here with an AttributeError; and the results are
checked against numpy."""
import queue
import threading

import numpy as np
import pytest

from paratrain.comm import ops
from paratrain.comm.algorithms import naive, ring, tree
from paratrain.comm.transport import Transport

F64 = ops.NUMPY_CODE[np.dtype(np.float64)]
I64 = ops.INT64


class _Done:
    """A Work that is already done, or does its receive when waited for."""

    def __init__(self, fn=None):
        self._fn = fn

    def wait(self, timeout=None):
        if self._fn is not None:
            self._fn()
            self._fn = None
        return True


class FakeTransport:
    """The Transport interface and only it: sends are buffered (copied into a queue
    per sender, receiver and tag), so they never block, as an eager protocol."""

    __slots__ = Transport.__slots__

    def __init__(self, rank, world_size, mailboxes):
        def box(src, dst, tag):
            with mailboxes["lock"]:
                return mailboxes.setdefault((src, dst, tag), queue.Queue())

        def send(buf, code, dst, tag):
            assert 0 <= dst < world_size and dst != rank, dst
            box(rank, dst, tag).put((code, buf.copy()))

        def recv(buf, code, src, tag):
            assert 0 <= src < world_size and src != rank, src
            sent_code, data = box(src, rank, tag).get(timeout=10)
            assert (sent_code, data.nbytes) == (code, buf.nbytes), (sent_code, data.nbytes, code, buf.nbytes)
            buf[...] = data

        def sendrecv(send_buf, dst, recv_buf, src, code, tag):
            send(send_buf, code, dst, tag)
            recv(recv_buf, code, src, tag)

        def isend(buf, code, dst, tag):
            send(buf, code, dst, tag)
            return _Done()

        def irecv(buf, code, src, tag):
            return _Done(lambda: recv(buf, code, src, tag))

        self.rank, self.world_size = rank, world_size
        self.send, self.recv, self.sendrecv, self.isend, self.irecv = send, recv, sendrecv, isend, irecv


def run_ranks(P, fn):
    """fn(transport) on P threads, one per rank; returns their results in rank order."""
    mailboxes = {"lock": threading.Lock()}
    results, errors = [None] * P, []

    def rank(r):
        try:
            results[r] = fn(FakeTransport(r, P, mailboxes))
        except BaseException as e:   # re-raised in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "an algorithm hung"
    return results


def inputs(P, n, dtype=np.float64):
    rng = np.random.default_rng(P * 1000 + n)
    return [rng.integers(-50, 50, n).astype(dtype) for _ in range(P)]   # integers: sums exact in any order


REDUCE = {"sum": lambda xs: np.sum(xs, axis=0), "max": lambda xs: np.max(xs, axis=0),
          "avg": lambda xs: np.mean(xs, axis=0)}


@pytest.mark.parametrize("module", [naive, ring, tree], ids=["naive", "ring", "tree"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("op", ["sum", "max", "avg"])
def test_all_reduce_uses_only_the_transport_and_agrees_with_numpy(monkeypatch, module, P, op):
    monkeypatch.setattr(ring, "PIPELINE_BYTES", 64)   # ring's pipelined chunks (isend) at test sizes
    for n in (0, 1, 7, 100):
        xs = inputs(P, n)

        def rank(t):
            buf = xs[t.rank].copy()
            module.all_reduce(t, buf, F64, op)
            return buf
        for got in run_ranks(P, rank):
            np.testing.assert_allclose(got, REDUCE[op](xs) if n else np.zeros(0), rtol=1e-12)


@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_rooted_and_gathering_collectives_use_only_the_transport(P):
    n = 6
    xs = inputs(P, n)
    pieces = [inputs(P, n, np.int64) for _ in range(P)]   # pieces[r][q]: rank r's piece for rank q
    for root in range(P):
        def rank(t, root=root):
            me = t.rank
            b = xs[me].copy() if me == root else np.zeros(n)
            tree.broadcast(t, b, F64, root)
            red = xs[me].copy()
            tree.reduce(t, red, F64, "sum", root)
            gathered = [np.zeros(n) for _ in range(P)] if me == root else None
            naive.gather(t, gathered, xs[me], F64, root)
            got = np.zeros(n, np.int64)
            naive.scatter(t, got, pieces[root] if me == root else None, I64, root)
            return b, red, gathered, got
        for me, (b, red, gathered, got) in enumerate(run_ranks(P, rank)):
            np.testing.assert_array_equal(b, xs[root])
            np.testing.assert_array_equal(red, np.sum(xs, axis=0) if me == root else xs[me])
            if me == root:
                np.testing.assert_array_equal(np.stack(gathered), np.stack(xs))
            np.testing.assert_array_equal(got, pieces[root][me])

    def rank(t):
        me = t.rank
        ag = [np.zeros(n) for _ in range(P)]
        naive.all_gather(t, ag, xs[me], F64)
        a2a = [np.zeros(n, np.int64) for _ in range(P)]
        naive.all_to_all(t, a2a, pieces[me], I64)
        rs = np.zeros(n, np.int64)
        naive.reduce_scatter(t, rs, pieces[me], I64, "sum")
        return ag, a2a, rs
    for me, (ag, a2a, rs) in enumerate(run_ranks(P, rank)):
        np.testing.assert_array_equal(np.stack(ag), np.stack(xs))
        np.testing.assert_array_equal(np.stack(a2a), np.stack([pieces[q][me] for q in range(P)]))
        np.testing.assert_array_equal(rs, np.sum([pieces[q][me] for q in range(P)], axis=0))


def test_a_group_hands_its_algorithms_a_transport_of_its_own_point_to_point():
    """ProcessGroup builds its transport from the backend's point to point, and the
    portable collectives reach the backend through it alone."""
    from paratrain.comm.group import ProcessGroup

    class Counting(ProcessGroup):
        calls = []

        def _send(self, buf, code, dst, tag):
            self.calls.append(("send", dst))

        def _recv(self, buf, code, src, tag):
            self.calls.append(("recv", src))
    g = Counting(1, 2)
    assert isinstance(g.transport, Transport) and (g.transport.rank, g.transport.world_size) == (1, 2)
    g.broadcast(np.zeros(3), src=0)
    assert Counting.calls == [("recv", 0)]
    g.destroy()
