"""Worker: point-to-point messages matched by peer and tag, as torch.distributed and MPI match them.

Started with 3 ranks by the launcher (tests/test_collectives.py) or by mpirun
(tests/test_mpi_backend.py); the backend is the first argument. Rank 0 is the
receiver in each case; every result is checked against the values the senders
built, and the script raises (exits non-zero) on the first wrong one.

1. irecv from rank 1 and from rank 2, the second waited first, while rank 1
   sends only after rank 0 has answered rank 2: the receives must not queue
   behind each other.
2. Rank 1 sends tag 1 then tag 2; rank 0 receives tag 2 first (shm keeps the
   early message aside, as MPI does; torch and MPI match tags themselves).
   Then rank 0 posts two irecvs and rank 1 sends, with blocking sends, the
   message of the second one first.
   Then rank 0 posts irecvs for tags 17 and 18 and waits for 18 alone; rank 1
   sends tag 17 only once rank 0 has answered tag 18: the second receive must
   not wait behind the first one (one reader per peer once held it there).
3. A user's multi-chunk isend still in the channel while the ranks run
   collectives whose algorithms send their own messages (ring, tree, naive,
   list all_to_all); received after them, intact.
4. A receive whose message has another size fails with a MismatchError, and
   the next message on the same channel still arrives whole (shm and mpi always;
   torch and hierarchical, where point to point runs over Gloo, which aborts the
   receiving process on such a message, with PARATRAIN_DEBUG=1: envelopes.py).
   A message of another dtype but the same size fails the same way on shm
   always, and with PARATRAIN_DEBUG=1 everywhere (MPI knows only bytes); checked
   with a blocking recv and with an irecv. With PARATRAIN_DEBUG on torch and
   hierarchical, a message too large to drain (envelopes.MAX_DRAIN_BYTES) closes
   its peer and tag: every later receive there fails at once, saying why.
5. Tags outside 0 .. 2**24-1, and a message to oneself, are refused before
   anything is sent.
6. ``wait(timeout)`` on an irecv whose message has not been sent raises
   TimeoutError and leaves the receive posted: the message, sent after, lands.
7. ``is_completed()`` polled in a loop turns True once the message is in.
8. Buffers a call only reads (what send/isend send, the inputs of reduce_scatter,
   all_to_all, all_gather, gather, scatter) may be read-only numpy arrays; the
   results are right and the inputs unchanged.
9. On shm, an isend that fits the channel's free frames is done when it returns
   (the caller copied it in); a larger one goes on the send lane, and a small one
   posted after it waits behind it: both arrive, the order kept.
10. A receive pending at ``pt.destroy()`` fails with CommError, at once (on torch
   within half a second), a second one of the same peer and tag too (with
   PARATRAIN_DEBUG queued behind the first: destroy() once hung there), whether
   it is waited for after the destroy or a thread
   is already waiting for it (on torch, inside Gloo's wait: that thread left
   there would also abort the process at its exit); an isend that finished before
   the destroy, waited for after it, succeeds.
"""
import os
import sys
import threading
import time

import numpy as np

import paratrain as pt


def check(got, want, what):
    if not np.array_equal(got, want):
        raise AssertionError(f"rank {pt.world().rank}: {what}: got {got[:4]}... want {want[:4]}...")


def main():
    backend = sys.argv[1]
    g = pt.init(backend=backend)
    assert g.backend == backend, f"asked for {backend}, got {g.backend}"
    me, P = g.rank, g.world_size
    assert P == 3, "run with 3 ranks"
    big = 50_000   # float32 elements: several 16 KiB chunks with the test's small shm chunks

    # 1. receives from two peers complete in either order
    if me == 0:
        a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
        wa, wb = g.irecv(a, 1, tag=3), g.irecv(b, 2, tag=3)
        wb.wait()
        g.send(np.full(1, 9, np.float32), 1, tag=4)
        wa.wait()
        check(a, np.full(4, 1, np.float32), "irecv from rank 1")
        check(b, np.full(4, 2, np.float32), "irecv from rank 2")
    elif me == 1:
        go = np.zeros(1, np.float32)
        g.recv(go, 0, tag=4)
        g.send(np.full(4, 1, np.float32), 0, tag=3)
    else:
        g.send(np.full(4, 2, np.float32), 0, tag=3)

    # 2. two tags from one peer, received in the other order
    if me == 1:
        w1 = g.isend(np.full(big, 11, np.float32), 0, tag=1)
        w2 = g.isend(np.full(5, 12, np.float32), 0, tag=2)
        w1.wait()
        w2.wait()
    elif me == 0:
        second, first = np.zeros(5, np.float32), np.zeros(big, np.float32)
        g.recv(second, 1, tag=2)
        g.recv(first, 1, tag=1)
        check(second, np.full(5, 12, np.float32), "tag 2 received first")
        check(first, np.full(big, 11, np.float32), "tag 1 received second")
    # 2b. the receive posted first is for the message sent second, by a blocking send
    # of a message over MPI's eager limit (which MPI holds until a receive matches it)
    if me == 1:
        g.send(np.full(big, 21, np.float32), 0, tag=13)
        g.send(np.full(5, 22, np.float32), 0, tag=14)
    elif me == 0:
        second, first = np.zeros(5, np.float32), np.zeros(big, np.float32)
        w_second, w_first = g.irecv(second, 1, tag=14), g.irecv(first, 1, tag=13)
        w_second.wait()
        w_first.wait()
        check(first, np.full(big, 21, np.float32), "the message whose receive was posted second")
        check(second, np.full(5, 22, np.float32), "the message whose receive was posted first")
    # 2c. a later receive from one peer completes while an earlier one still waits
    if me == 1:
        g.send(np.full(5, 32, np.float32), 0, tag=18)
        g.recv(np.zeros(1, np.float32), 0, tag=19)
        g.send(np.full(big, 31, np.float32), 0, tag=17)
    elif me == 0:
        first, second = np.zeros(big, np.float32), np.zeros(5, np.float32)
        w_first, w_second = g.irecv(first, 1, tag=17), g.irecv(second, 1, tag=18)
        w_second.wait()
        assert not w_first.is_completed(), "tag 17 done before rank 1 sent it"
        check(second, np.full(5, 32, np.float32), "the later receive, completed first")
        g.send(np.ones(1, np.float32), 1, tag=19)
        w_first.wait()
        check(first, np.full(big, 31, np.float32), "the earlier receive, completed second")
    g.barrier()

    # 3. a user's message waits in the channel while collectives' algorithms talk
    pending = g.isend(np.arange(big, dtype=np.float32) + me, (me + 1) % P, tag=7)
    for algo in ("ring", "tree", "naive"):
        x = np.full(big, me + 1, np.float32)
        g.all_reduce(x, algorithm=algo)
        check(x, np.full(big, P * (P + 1) / 2, np.float32), f"all_reduce({algo}) with a user message pending")
    outs = [np.zeros(q + 1, np.float32) for q in range(P)]
    g.all_to_all(outs, [np.full(me + 1, 10 * me + q, np.float32) for q in range(P)])
    for q in range(P):
        check(outs[q], np.full(q + 1, 10 * q + me, np.float32), "list all_to_all with a user message pending")
    got = np.zeros(big, np.float32)
    g.recv(got, (me - 1) % P, tag=7)
    pending.wait()
    check(got, np.arange(big, dtype=np.float32) + (me - 1) % P, "the user message received after the collectives")

    # 4. a message of the wrong size or dtype fails its receive; the channel goes on
    debug = os.environ.get("PARATRAIN_DEBUG", "0") == "1"
    if backend in ("shm", "mpi") or debug:   # Gloo aborts the process on a wrong size unless checked
        if me == 1:
            g.send(np.full(6, 5, np.float32), 0, tag=8)
            g.send(np.full(3, 6, np.float32), 0, tag=9)
        elif me == 0:
            try:
                g.recv(np.zeros(4, np.float32), 1, tag=8)
                raise AssertionError("a 6-element message landed in a 4-element receive")
            except pt.MismatchError as e:
                assert "24 bytes" in str(e) and "16 bytes" in str(e), e
            after = np.zeros(3, np.float32)
            g.recv(after, 1, tag=9)
            check(after, np.full(3, 6, np.float32), "the message after a mismatched one")
    if backend == "shm" or debug:   # same size, another dtype: MPI and Gloo know only bytes
        if me == 1:
            g.send(np.full(4, 1.5, np.float32), 0, tag=8)
            w = g.isend(np.full(4, 2.5, np.float32), 0, tag=8)
            g.send(np.full(5, 7, np.int32), 0, tag=9)
            w.wait()
        elif me == 0:
            for how in ("recv", "irecv"):
                wrong = np.zeros(4, np.int32)
                try:
                    g.recv(wrong, 1, tag=8) if how == "recv" else g.irecv(wrong, 1, tag=8).wait()
                    raise AssertionError(f"float32 x 4 landed in an int32 x 4 {how}: {wrong}")
                except pt.MismatchError as e:
                    assert "float32" in str(e) and "int32" in str(e), e
            after = np.zeros(5, np.int32)
            g.recv(after, 1, tag=9)
            check(after, np.full(5, 7, np.int32), "the message after a wrong-dtype one")
    left_behind = []
    if debug and backend in ("torch", "hierarchical"):
        # a message that does not fit and is too large to drain stays ahead of every
        # later one of its peer and tag: those receives fail at once, saying why
        # (Gloo aborted the process on the next one); the isends are given up at destroy
        from paratrain.comm.envelopes import MAX_DRAIN_BYTES
        if me == 1:
            left_behind = [g.isend(np.ones(MAX_DRAIN_BYTES + 4, np.uint8), 0, tag=24),
                           g.isend(np.full(2, 3, np.uint8), 0, tag=24)]
        elif me == 0:
            for words in ("left on the channel", "cannot go on"):
                try:
                    g.recv(np.zeros(2, np.uint8), 1, tag=24)
                    raise AssertionError("a receive went on behind an undrained message")
                except pt.MismatchError as e:
                    assert words in str(e) and str(MAX_DRAIN_BYTES + 4) in str(e), e

    # 5. tags outside the user's range
    for bad in (-1, 1 << 24, 2.0):
        try:
            g.isend(np.zeros(1, np.float32), (me + 1) % P, tag=bad)
            raise AssertionError(f"tag {bad!r} accepted")
        except ValueError as e:
            assert "tag" in str(e), e
    for call in (g.send, g.isend, g.recv, g.irecv):
        try:
            call(np.zeros(1, np.float32), me)
            raise AssertionError(f"{call.__name__} with this rank as the peer accepted")
        except ValueError as e:
            assert "itself" in str(e), e

    # 6. a wait that times out leaves its receive posted
    if me == 0:
        late = np.zeros(3, np.float32)
        w = g.irecv(late, 2, tag=11)
        try:
            w.wait(timeout=0.2)
            raise AssertionError("wait(timeout=0.2) returned before rank 2 sent anything")
        except TimeoutError:
            pass
        assert not w.is_completed() and w.exception() is None
        g.send(np.ones(1, np.float32), 2, tag=12)
        w.wait()
        assert w.is_completed() and w.exception() is None
        check(late, np.full(3, 7, np.float32), "the message sent after a timed-out wait")
    elif me == 2:
        g.recv(np.zeros(1, np.float32), 0, tag=12)
        g.send(np.full(3, 7, np.float32), 0, tag=11)
    g.barrier()

    # 7. is_completed() turns True by itself once the message is in (Gloo's handles
    # say so only after a wait(), so paratrain's Work watches for it)
    if me in (0, 1):
        peer = 1 - me
        box = np.full(1000, me, np.float32)
        w = g.irecv(box, peer, tag=15) if me == 0 else g.isend(box, peer, tag=15)
        deadline = time.monotonic() + 20
        while not w.is_completed():
            assert time.monotonic() < deadline, f"{w!r} never said it was complete"
            time.sleep(0.01)
        assert w.exception() is None and w.wait(timeout=1)
        if me == 0:
            check(box, np.full(1000, 1, np.float32), "the message polled for with is_completed()")
    g.barrier()

    # 8. read-only buffers where the call only reads them
    def frozen(a):
        a = np.array(a)
        a.flags.writeable = False
        return a
    if me == 0:
        g.send(frozen(np.full(big, 41, np.float32)), 1, tag=20)
        g.isend(frozen(np.full(9, 42, np.float32)), 2, tag=21).wait()
    else:
        got = np.zeros(big if me == 1 else 9, np.float32)
        g.recv(got, 0, tag=20 if me == 1 else 21)
        check(got, np.full(got.size, 40 + me, np.float32), "a read-only array sent")
    n = 1001
    for dtype in (np.float32, np.float16):
        base = (np.arange(P * n) % 100).astype(dtype)
        src = frozen(base + me)
        out = np.zeros(n, dtype)
        g.reduce_scatter(out, src)
        check(out, sum(base[me * n:(me + 1) * n] + r for r in range(P)), f"reduce_scatter of a read-only {dtype}")
        check(src, base + me, "a read-only reduce_scatter input, after the call")
    pieces = [frozen(np.full(n, 10 * me + q, np.float32)) for q in range(P)]
    outs = [np.zeros(n, np.float32) for _ in range(P)]
    g.all_to_all(outs, pieces)
    for q in range(P):
        check(outs[q], np.full(n, 10 * q + me, np.float32), "all_to_all of read-only pieces")
        check(pieces[q], np.full(n, 10 * me + q, np.float32), "a read-only all_to_all piece, after the call")
    mine = frozen(np.full(n, me, np.float32))
    everyone = np.zeros(P * n, np.float32)
    g.all_gather(everyone, mine)
    check(everyone, np.repeat(np.arange(P, dtype=np.float32), n), "all_gather of a read-only input")
    gathered = [np.zeros(n, np.float32) for _ in range(P)] if me == 0 else None
    g.gather(mine, gathered, dst=0)
    if me == 0:
        check(np.concatenate(gathered), np.repeat(np.arange(P, dtype=np.float32), n), "gather of read-only inputs")
    out = np.zeros(n, np.float32)
    g.scatter(out, [frozen(np.full(n, 5 + q, np.float32)) for q in range(P)] if me == 0 else None, src=0)
    check(out, np.full(n, 5 + me, np.float32), "scatter of a read-only scatter_list")
    check(mine, np.full(n, me, np.float32), "a read-only all_gather/gather input, after the calls")
    try:
        g.all_reduce(frozen(np.ones(3, np.float32)))
        raise AssertionError("all_reduce into a read-only array accepted")
    except ValueError as e:
        assert "read-only" in str(e), e
    g.barrier()

    # 9. on shm an isend that fits the channel's free frames is copied in by the caller:
    # done when isend returns, before the peer receives; one that needs more frames goes
    # on the send lane, and a small one after it waits its turn there (order kept)
    if backend == "shm" and os.environ.get("PARATRAIN_DEBUG", "0") == "0":
        if me == 1:
            small = g.isend(np.full(5, 51, np.float32), 0, tag=25)
            assert small.is_completed(), "a small isend on shm not done when it returned"
            large = g.isend(np.full(big, 52, np.float32), 0, tag=26)
            behind = g.isend(np.full(3, 53, np.float32), 0, tag=27)
            assert not large.is_completed() and not behind.is_completed(), "sent before rank 0 received"
            g.barrier()
            for w in (small, large, behind):
                w.wait()
        else:
            g.barrier()
            if me == 0:
                got = [np.zeros(3, np.float32), np.zeros(5, np.float32), np.zeros(big, np.float32)]
                for buf, tag in zip(got, (27, 25, 26)):   # the last one sent, received first
                    g.recv(buf, 1, tag=tag)
                for buf, value in zip(got, (53, 51, 52)):
                    check(buf, np.full(buf.size, value, np.float32), "isends on shm, copied in or on the lane")
        g.barrier()

    # 10. a receive still pending at pt.destroy() fails with CommError, at once: on mpi
    # without probing the freed communicator (which MPI answers by aborting the job), on
    # shm and torch without waiting out the timeout (a posted Gloo receive cannot be
    # withdrawn: a wait begun after the destroy gives it a last look)
    # An isend that finished before the destroy, waited for after it, succeeds.
    finished = g.isend(np.full(3, me, np.float32), (me + 1) % P, tag=22)
    got = np.zeros(3, np.float32)
    g.recv(got, (me - 1) % P, tag=22)
    check(got, np.full(3, (me - 1) % P, np.float32), "the message of an isend waited after destroy")
    g.barrier()
    pending = g.irecv(np.zeros(1, np.float32), (me + 1) % P, tag=16)
    queued = g.irecv(np.zeros(1, np.float32), (me + 1) % P, tag=16)   # with debug: behind it on its lane
    blocked, outcome = g.irecv(np.zeros(1, np.float32), (me + 1) % P, tag=23), []

    def wait_blocked():
        try:
            blocked.wait()
            outcome.append("completed")
        except Exception as e:
            outcome.append(e)
    waiter = threading.Thread(target=wait_blocked, daemon=True)
    waiter.start()
    time.sleep(0.2)   # the waiter is inside the engine's wait (Gloo's) when the group goes
    pt.destroy()
    waiter.join(5)
    assert outcome and isinstance(outcome[0], pt.CommError) and "destroyed" in str(outcome[0]), \
        f"a wait under way at destroy(): {outcome or 'still waiting after 5 s'}"
    finished.wait()
    start = time.monotonic()
    for work in [pending, queued] + left_behind:
        try:
            work.wait()
            raise AssertionError(f"{work.what}, pending at destroy(), completed")
        except pt.CommError as e:
            assert "destroyed" in str(e), e
    assert time.monotonic() - start < 5, "a receive pending at destroy() waited for its timeout"
    print(f"p2p matching checks passed on {backend}", flush=True)


if __name__ == "__main__":
    main()
