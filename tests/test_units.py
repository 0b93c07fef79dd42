"""In-process pieces: environment parsing, ops and dtypes, a world of one."""
import numpy as np
import pytest
import torch

from paratrain.comm import ops
from paratrain.comm.env import read_env


def test_env_torchrun_style():
    e = read_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.master_addr, e.master_port) == \
        (3, 4, 1, 2, "10.0.0.1", 1234)


def test_env_openmpi():
    e = read_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    assert (e.rank, e.world_size, e.local_rank, e.source) == (2, 3, 0, "openmpi")


def test_env_slurm():
    e = read_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
                  "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.master_addr) == (5, 8, 1, 4, "10.1.1.1")


def test_env_nothing_is_a_world_of_one():
    e = read_env({})
    assert (e.rank, e.world_size, e.source) == (0, 1, "single")


@pytest.mark.parametrize("env,words", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "outside the world"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "at least 1"),
])
def test_env_errors(env, words):
    with pytest.raises(ValueError, match=words):
        read_env(env)


@pytest.mark.parametrize("text, expected", [("65536", 65536), ("256K", 256 << 10), ("1M", 1 << 20),
                                           ("2mb", 2 << 20), (" 1G ", 1 << 30)])
def test_shm_sizes_from_the_environment(monkeypatch, text, expected):
    from paratrain import config
    monkeypatch.setenv("PARATRAIN_SHM_SLOT_BYTES", text)
    assert config.get("PARATRAIN_SHM_SLOT_BYTES") == expected
    monkeypatch.setenv("PARATRAIN_SHM_SLOT_BYTES", "")   # empty is unset, as for every setting
    assert config.get("PARATRAIN_SHM_SLOT_BYTES") == 1 << 20
    monkeypatch.delenv("PARATRAIN_SHM_SLOT_BYTES")
    assert config.get("PARATRAIN_SHM_SLOT_BYTES") == 1 << 20


@pytest.mark.parametrize("text", ["abc", "0", "-5", "1.5M", "K"])
def test_a_bad_shm_size_names_the_variable(monkeypatch, text):
    from paratrain import config
    monkeypatch.setenv("PARATRAIN_SHM_CHUNK_BYTES", text)
    with pytest.raises(ValueError, match="PARATRAIN_SHM_CHUNK_BYTES=.* is not valid .*positive number of bytes|bad size"):
        config.get("PARATRAIN_SHM_CHUNK_BYTES")


def test_op_names():
    assert ops.normalize_op("SUM") == "sum"
    assert ops.normalize_op(torch.distributed.ReduceOp.MAX) == "max"
    assert ops.normalize_op("average") == "avg"
    # an instance, as torch code builds it, keeps its enum value in .op
    assert ops.normalize_op(torch.distributed.ReduceOp(torch.distributed.ReduceOp.PRODUCT)) == "prod"
    assert ops.normalize_op(torch.distributed.ReduceOp(torch.distributed.ReduceOp.MIN)) == "min"
    with pytest.raises(ValueError, match="unknown reduce op"):
        ops.normalize_op("median")
    with pytest.raises(ValueError, match="unknown reduce op .*BXOR"):
        ops.normalize_op(torch.distributed.ReduceOp(torch.distributed.ReduceOp.BXOR))
    with pytest.raises(ValueError, match="ambiguous"):
        ops.check_op_dtype("avg", ops.DTYPE_CODE[torch.int64])


def test_as_buffer_shares_memory_and_refuses_what_it_cannot_write_in_place():
    t = torch.zeros(6, dtype=torch.bfloat16)
    buf, code = ops.as_buffer(t)
    buf[:] = np.array([0x3F80] * 6, dtype=np.uint16)  # bf16 bits of 1.0
    assert code == 2 and t.tolist() == [1.0] * 6
    with pytest.raises(ValueError, match="contiguous"):
        ops.as_buffer(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="supported"):
        ops.as_buffer(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="torch.Tensor or numpy"):
        ops.as_buffer([1, 2, 3])
    ro = np.zeros(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ops.as_buffer(ro)


def test_as_buffer_fast_paths_agree_with_the_checked_ones():
    """The exact-type shortcuts (plain numpy array, plain torch tensor) and the full
    checks (subclasses, grad, bfloat16, refused dtypes) give the same flat views."""
    class Sub(np.ndarray):
        pass
    grid = np.arange(12, dtype=np.float32).reshape(3, 4)
    w = torch.nn.Parameter(torch.arange(6, dtype=torch.float64).reshape(2, 3))
    for x, code in ((grid, 3), (grid.view(Sub), 3), (torch.from_numpy(grid), 3), (w, 4),
                    (torch.zeros(5, dtype=torch.float16), 1), (torch.zeros(2, 2, dtype=torch.uint8), 7)):
        buf, got = ops.as_buffer(x)
        assert got == code and buf.ndim == 1 and buf.size == (x.numel() if torch.is_tensor(x) else x.size)
        buf[-1] = 99   # a view: the write lands in the caller's tensor
        assert np.asarray(x.detach() if torch.is_tensor(x) else x).reshape(-1)[-1] == 99
    with pytest.raises(TypeError, match="torch.int16; supported"):
        ops.as_buffer(torch.zeros(3, dtype=torch.int16))
    with pytest.raises(TypeError, match="numpy dtype int16; supported"):
        ops.as_buffer(np.zeros(3, dtype=np.int16))
    with pytest.raises(ValueError, match="contiguous"):
        ops.as_buffer(np.zeros((4, 4)).T)


def test_address_is_the_first_byte_for_every_kind_of_array():
    a = np.arange(10, dtype=np.int64)
    ro = np.arange(4.0)
    ro.flags.writeable = False
    for x in (a, a[3:], a[3:3], ro, np.zeros(0)):   # empty and read-only ones fall back to ctypes
        assert ops.address(x) == x.ctypes.data



def test_span_joins_pieces_only_when_they_lie_end_to_end():
    flat = np.arange(12, dtype=np.float32)
    whole = ops.span([flat[0:4], flat[4:8], flat[8:12]])
    whole[5] = -1   # a view of the caller's memory, covering exactly the pieces
    assert whole.size == 12 and flat[5] == -1
    assert ops.span([flat[0:4], flat[5:9]]) is None             # a gap
    assert ops.span([flat[4:8], flat[0:4]]) is None             # out of order
    assert ops.span([np.zeros(3), np.zeros(3)]) is None         # two allocations
    assert ops.span([flat[0:0], flat[0:0]]).size == 0


def test_overlaps_finds_a_shared_byte_with_any_piece_and_only_then():
    flat = np.arange(12, dtype=np.float32)
    pieces = [flat[0:4], flat[4:8], flat[8:12]]
    assert ops.overlaps(flat[8:12], pieces)          # in place: the output is piece 2
    assert ops.overlaps(flat[7:9], pieces)           # straddles two pieces
    assert ops.overlaps(flat[3:4], [flat[0:4]])      # the last byte range of a piece
    assert not ops.overlaps(flat[4:8], [flat[0:4], flat[8:12]])   # touching, not sharing
    assert not ops.overlaps(np.zeros(4, np.float32), pieces)
    assert not ops.overlaps(flat[4:4], pieces)       # empty shares nothing

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.uint8])
def test_combine_matches_torch(dtype):
    a = (torch.arange(50) % 7 + 1).to(dtype)
    b = (torch.arange(50) % 5 + 2).to(dtype)
    for op, ref in (("sum", a + b), ("max", torch.maximum(a, b)), ("min", torch.minimum(a, b)), ("prod", a * b)):
        out = torch.empty_like(a)
        ab, code = ops.as_buffer(a)
        ops.combine(ops.as_buffer(out)[0], ab, ops.as_buffer(b)[0], op, code)
        assert torch.equal(out, ref), (op, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 8])
def test_finish_avg_gives_the_bits_of_a_division(dtype, world_size):
    """A power-of-two world multiplies by 1/P instead of dividing: same bits, tiny and huge values too."""
    g = torch.Generator().manual_seed(world_size)
    t = torch.randn(4096, generator=g, dtype=torch.float64) * torch.logspace(-300, 300, 4096, dtype=torch.float64)
    t = t.to(dtype)
    t[:8] = torch.finfo(dtype).tiny * torch.arange(8)   # subnormal results
    out = t.clone()
    buf, code = ops.as_buffer(out)
    ops.finish_avg(buf, world_size, code)
    bits = torch.int16 if t.element_size() == 2 else (torch.int32 if t.element_size() == 4 else torch.int64)
    assert torch.equal(out.view(bits), (t / world_size).view(bits))

@pytest.mark.timeout(60)
def test_world_of_one_in_process(monkeypatch):
    import paratrain as pt
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    g = pt.init(backend="shm")
    try:
        assert (g.rank, g.world_size) == (0, 1)
        x = torch.arange(10.0)
        g.all_reduce(x, op="avg")
        assert torch.equal(x, torch.arange(10.0))
        out = torch.empty(10)
        g.all_gather(out, x)
        assert torch.equal(out, x)
        g.all_reduce(x, async_op=True).wait()
        with pytest.raises(ValueError, match="not in this group"):
            g.send(x, 1)
        with pytest.raises(ValueError, match="world_size x 10"):
            g.all_gather(torch.empty(11), x)
        with pytest.raises(ValueError, match="unknown algorithm"):
            g.all_reduce(x, algorithm="butterfly")
    finally:
        pt.destroy()


@pytest.mark.parametrize("algo", ["ring", "tree", "naive"])
def test_paratrain_algo_picks_the_algorithm_and_a_call_overrides_it(monkeypatch, algo):
    """PARATRAIN_ALGO, like NCCL_ALGO: every all_reduce of groups made after it is set."""
    import paratrain as pt
    from paratrain.comm.algorithms import naive, ring, tree
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PARATRAIN_ALGO", algo)
    g = pt.init(backend="shm")
    try:
        assert g._algorithm(None, 1 << 20) is {"ring": ring, "tree": tree, "naive": naive}[algo]
        assert g._algorithm("direct", 1 << 20) is None   # a call's own choice wins
        x = torch.arange(10.0)
        g.all_reduce(x)
        assert torch.equal(x, torch.arange(10.0))
    finally:
        pt.destroy()
    monkeypatch.setenv("PARATRAIN_ALGO", "butterfly")
    g = pt.init(backend="shm")
    try:
        with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
            g.all_reduce(torch.ones(3))
    finally:
        pt.destroy()


def test_cma_reads_another_process_and_names_a_dead_one():
    """shm/cma.py: process_vm_readv copies a live peer's memory; once the peer has
    exited, the read raises PeerError naming its rank, not garbage or a hang."""
    from paratrain.comm.shm import cma
    from paratrain.comm.errors import PeerError
    from conftest import child_with_buffer
    p, addr, want = child_with_buffer()
    try:
        got = np.zeros(5, dtype=np.int64)
        try:
            cma.read(p.pid, got, addr, rank=1)
        except OSError as e:
            pytest.skip(f"this kernel does not let a process read a sibling's memory: {e}")
        np.testing.assert_array_equal(got, want)
        with pytest.raises(OSError, match="rank 1"):
            cma.read(p.pid, got, 8, rank=1)   # an address the peer has not mapped
    finally:
        p.communicate("")
    with pytest.raises(PeerError, match=r"rank 1 \(pid"):
        cma.read(p.pid, got, addr, rank=1)


def test_point_to_point_arguments_refused_before_anything_moves():
    """The checks every backend shares (ProcessGroup._p2p_args), on a group that
    could not send anything: a wrong peer or tag is refused up front."""
    from paratrain.comm.group import ProcessGroup
    g = ProcessGroup(0, 3)
    t = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="no receive from any source"):
        g.recv(t, None)
    with pytest.raises(ValueError, match="cannot send to or receive from itself"):
        g.isend(t, 0)
    with pytest.raises(ValueError, match="not in this group of 3 ranks"):
        g.irecv(t, 3)
    with pytest.raises(ValueError, match="tag 16777216 must be an int from 0"):
        g.send(t, 1, tag=1 << 24)


def test_posted_receives_probe_only_the_oldest_of_each_source_and_tag():
    """mpi_receives.MpiReceives (over matching.PostedReceives): MPI's order rule (two
    receives for one source and tag match in posting order) while receives for other
    tags match as they come."""
    from paratrain.comm.mpi_receives import MpiReceive, MpiReceives
    polled = []
    arrived = set()

    def poll(name):
        def p():
            polled.append(name)
            if name == "bad":
                raise ValueError("wrong size")
            return name in arrived
        return p

    q = MpiReceives()
    a1, a2 = q.post(MpiReceive(1, 5, poll("a1"))), q.post(MpiReceive(1, 5, poll("a2")))
    b, c = q.post(MpiReceive(1, 6, poll("b"))), q.post(MpiReceive(2, 5, poll("c")))
    q.progress()
    assert polled == ["a1", "b", "c"]          # a2 waits for a1, the older receive of (1, 5)
    arrived.update({"b", "a2"})
    polled.clear()
    assert q.done(b) and not q.done(a2)        # b matched out of posting order; a2 still behind a1
    assert "a2" not in polled
    arrived.add("a1")
    assert not q.done(a2) and a1.done          # a1 leaves the queue; a2 is probed from the next round
    assert q.done(a2) and a2.error is None
    bad = q.post(MpiReceive(3, 1, poll("bad")))
    assert q.done(bad) and isinstance(bad.error, ValueError)   # kept for its owner to raise
    q.withdraw(c)
    polled.clear()
    q.progress()
    assert polled == []                         # nothing left: c withdrawn, the rest finished


def test_posted_receive_futures_settle_from_whichever_side_ends_first():
    """The Work of a receive posted at call time (work.posted_work): done when the
    receive is finished by any thread, even while its own lane job waits behind
    another; failed with the job's error if the job fails first; a CommError if
    the group is destroyed before the job starts. And the mpi queue settles a
    receive's future when another thread's progress finishes it."""
    import concurrent.futures
    import threading

    from paratrain.comm.errors import CommError
    from paratrain.comm.mpi_receives import MpiReceive, MpiReceives
    from paratrain.comm.work import Lanes, posted_work
    lanes = Lanes("unit")
    gate = threading.Event()
    first, second = concurrent.futures.Future(), concurrent.futures.Future()
    w1 = posted_work(lanes, "recv-1", first, gate.wait, "irecv one")
    w2 = posted_work(lanes, "recv-1", second, lambda: None, "irecv two")
    second.set_result(None)                      # its message delivered by another thread
    assert w2.wait(timeout=2) and not w1.is_completed()
    gate.set()
    first.set_result(None)
    assert w1.wait(timeout=2)

    failing = concurrent.futures.Future()
    w3 = posted_work(lanes, "recv-2", failing, lambda: 1 / 0, "irecv three")
    with pytest.raises(ZeroDivisionError):
        w3.wait(timeout=2)

    block = threading.Event()
    posted_work(lanes, "recv-3", concurrent.futures.Future(), block.wait, "irecv four")
    w5 = posted_work(lanes, "recv-3", concurrent.futures.Future(), lambda: None, "irecv five")
    lanes.shutdown()
    with pytest.raises(CommError, match="destroyed"):
        w5.wait(timeout=2)                        # never started: cancelled by the shutdown
    block.set()                                   # let w4's job, running at the shutdown, end

    q = MpiReceives()
    fut = concurrent.futures.Future()
    entry = q.post(MpiReceive(1, 5, lambda: True, fut))
    other = q.post(MpiReceive(2, 5, lambda: False))
    assert not q.done(other)                     # progress made for `other` finishes `entry` too
    assert entry.done and fut.done() and fut.exception() is None


def test_lanes_shutdown_waits_for_running_jobs_only():
    """Lanes.shutdown(wait_s): the running job gets up to wait_s to end; a queued one
    it cancels does not hold it for the whole wait_s (a cancelled future never
    counts as done for concurrent.futures.wait, so waiting on it would hold destroy())."""
    import threading
    import time as _time

    from paratrain.comm.errors import CommError
    from paratrain.comm.work import Lanes
    lanes = Lanes("unit")
    started = threading.Event()
    running = lanes.submit("a", lambda: (started.set(), _time.sleep(0.2)), "running job")
    queued = lanes.submit("a", lambda: None, "queued job")
    assert started.wait(5)
    begin = _time.monotonic()
    lanes.shutdown(wait_s=30)
    assert _time.monotonic() - begin < 10, "shutdown waited for the cancelled job"
    assert running.is_completed()   # the running job was waited for
    with pytest.raises(CommError, match="destroyed"):
        queued.wait(timeout=1)


def test_shm_mailbox_gives_a_message_to_a_receive_posted_while_it_was_read():
    """shm matching: a message read with no receive for it is kept, unless a receive
    with its tag was posted while it was read, which then takes it; posting takes a
    kept message first, oldest of its tag first."""
    from paratrain.comm.shm.matching import Mailbox, ShmReceive
    box = Mailbox(1)
    payload = np.arange(3, dtype=np.uint8)
    assert box.take_posted(4) is None            # the reader finds no receive for tag 4 ...
    late = ShmReceive(1, 4, np.zeros(3, np.uint8), 0)
    assert box.post(late) is None                # ... one is posted meanwhile ...
    assert box.keep(4, 0, payload) is late and not box.unexpected   # ... and takes the message
    assert box.keep(7, 0, payload) is None and box.keep(7, 0, payload + 1) is None
    kept = box.post(ShmReceive(1, 7, np.zeros(3, np.uint8), 0))
    assert kept[0] == 7 and np.array_equal(kept[2], payload) and len(box.unexpected) == 1
    waiting = ShmReceive(1, 9, np.zeros(3, np.uint8), 0)
    box.post(waiting)
    box.withdraw(waiting)
    assert box.take_posted(9) is None


def test_envelope_says_dtype_size_and_tag_and_refuses_what_is_not_one():
    """envelopes.py (PARATRAIN_DEBUG's point-to-point check on torch and mpi): an
    envelope read back gives the sender's dtype code and byte count; a corrupt one,
    or one for another tag, is a FrameError before anything is received."""
    from paratrain.comm import envelopes
    from paratrain.comm.errors import FrameError
    buf = np.zeros(6, np.float32)
    env = envelopes.envelope(buf, ops.NUMPY_CODE[np.dtype(np.float32)], 9)
    assert envelopes.read_envelope(env, 9, "recv") == (ops.NUMPY_CODE[np.dtype(np.float32)], 24)
    with pytest.raises(FrameError, match="tag 9, not 10"):
        envelopes.read_envelope(env, 10, "recv")
    bad = env.copy()
    bad[0] ^= 0xFF
    with pytest.raises(FrameError, match="magic"):
        envelopes.read_envelope(bad, 9, "recv")
    assert envelopes.ENVELOPE_TAG + (1 << 24) - 1 < 2 ** 31 - 1   # within Gloo's and Open MPI's tags


def test_envelope_send_errors_name_the_users_call():
    """AllOf: an isend behind its envelope fails with the user's call named (the
    engine's words name the envelope's internal tag), and its exception() says so."""
    import concurrent.futures

    from paratrain.comm.envelopes import AllOf
    from paratrain.comm.errors import PeerError
    from paratrain.comm.work import Work
    failed, done = concurrent.futures.Future(), concurrent.futures.Future()
    failed.set_exception(PeerError("isend of 32 bytes to rank 1 (tag 33554441) failed", [1]))
    done.set_result(None)
    w = AllOf(Work(failed, "envelope"), Work(done, "message"), "isend of 8 bytes to rank 1 (tag 9)")
    with pytest.raises(PeerError, match=r"isend of 8 bytes to rank 1 \(tag 9\), passing its envelope") as e:
        w.wait()
    assert e.value.ranks == (1,)
    assert isinstance(w.exception(), PeerError) and w.is_completed()


def test_reaped_lanes_end_their_thread_and_keep_their_order():
    """Lanes.submit(reap=True) (envelopes.py's lane per peer and tag): jobs queued on
    one lane still run in order, and once the lane is idle its thread ends, so a
    program using a tag per micro-batch does not keep a thread per tag."""
    import threading
    import time

    from paratrain.comm.work import Lanes
    lanes, order, gate = Lanes("test"), [], threading.Event()
    before = threading.active_count()
    works = [lanes.submit("a", lambda: gate.wait(5), "first", reap=True)]
    works += [lanes.submit("a", lambda i=i: order.append(i), f"job {i}", reap=True) for i in range(5)]
    gate.set()
    for w in works:
        w.wait(5)
    assert order == list(range(5))
    for tag in range(50):
        lanes.submit(f"tag-{tag}", lambda: None, "one", reap=True).wait(5)
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before, [t.name for t in threading.enumerate()]
    kept = Lanes("test")
    kept.submit("b", lambda: None, "kept").wait(5)
    assert threading.active_count() == before + 1   # a lane without reap stays, as the per-peer ones do
    kept.shutdown()
    lanes.shutdown()


def test_default_algorithm_follows_message_size_and_world_size():
    """The choice made when neither algorithm= nor PARATRAIN_ALGO names one.
    The portable collectives (ProcessGroup, over send/recv): tree up to 64 KiB,
    where latency steps dominate, ring above. shm's direct all_reduce: its
    one-round small path while every rank's slot holds the message and the bytes
    each rank reads from its peers, (P-1)·n, stay within direct.SMALL_BYTES, so
    the same 200 KiB takes it with 2 ranks and not with 4."""
    from types import SimpleNamespace

    from paratrain.comm.shm import direct
    from paratrain.comm.group import ProcessGroup
    portable = ProcessGroup(0, 2)
    assert [portable.default_algorithm(n) for n in (4, 64 * 1024, 64 * 1024 + 1, 64 << 20)] == \
        ["tree", "tree", "ring", "ring"]
    assert portable._algorithm(None, 4).__name__.endswith("tree")
    assert portable._algorithm(None, 1 << 20).__name__.endswith("ring")
    msg = np.zeros(200 * 1024 // 4, np.float32)
    small = [direct.takes_small_path(SimpleNamespace(slot_bytes=1 << 20, world_size=P), msg) for P in (2, 3, 4)]
    assert small == [True, True, False]   # (P-1) x 200 KiB against 512 KiB
    assert not direct.takes_small_path(SimpleNamespace(slot_bytes=128 * 1024, world_size=2), msg)


@pytest.mark.timeout(20)
def test_shutdown_with_a_job_queued_on_a_reaped_lane_returns():
    """shutdown() cancels the queued job, whose end must not shut its executor down
    again from inside shutdown (it waited forever on the executor's own lock: two
    PARATRAIN_DEBUG irecvs of one peer and tag pending at pt.destroy())."""
    import threading

    from paratrain.comm.errors import CommError
    from paratrain.comm.work import Lanes
    lanes, gate = Lanes("test"), threading.Event()
    running = lanes.submit("checked-recv-1-5", lambda: gate.wait(10), "first", reap=True)
    queued = lanes.submit("checked-recv-1-5", lambda: None, "second", reap=True)
    done = threading.Event()
    threading.Thread(target=lambda: (lanes.shutdown(), done.set()), daemon=True).start()
    assert done.wait(5), "Lanes.shutdown() did not return"
    with pytest.raises(CommError, match="never started"):
        queued.wait(1)
    gate.set()
    running.wait(5)


def test_envelope_send_timeout_names_the_users_call():
    """wait(timeout) on an isend behind its envelope: the TimeoutError names the
    user's call and the timeout given (it named the envelope's 32 bytes and internal
    tag, and the time left to the deadline)."""
    import concurrent.futures

    from paratrain.comm.envelopes import AllOf
    from paratrain.comm.work import Work
    never = concurrent.futures.Future()
    w = AllOf(Work(never, "isend of 32 bytes to rank 1 (tag 33554433)"), Work(never, "message"),
              "isend of 16 bytes to rank 1 (tag 1)")
    with pytest.raises(TimeoutError, match=r"^isend of 16 bytes to rank 1 \(tag 1\) not finished after 0.05s$"):
        w.wait(0.05)


def test_one_spin_policy_for_every_backend(monkeypatch):
    """spin.py: a wait spins while every rank on the host can have a core of its own,
    not at all when they cannot; a backend's variable (microseconds) overrides; and
    only the main thread spins (a spin holds the GIL the training thread needs)."""
    import threading

    from paratrain.comm import spin
    monkeypatch.setattr(spin.os, "cpu_count", lambda: 4)
    monkeypatch.delenv("PARATRAIN_SHM_SPIN_US", raising=False)
    assert spin.spin_seconds(4, "PARATRAIN_SHM_SPIN_US") == spin.SPIN_S
    assert spin.spin_seconds(5, "PARATRAIN_SHM_SPIN_US") == 0.0
    monkeypatch.setenv("PARATRAIN_SHM_SPIN_US", "50")
    assert spin.spin_seconds(5, "PARATRAIN_SHM_SPIN_US") == pytest.approx(50e-6)
    assert spin.for_this_thread(1.0) == 1.0
    seen = []
    t = threading.Thread(target=lambda: seen.append(spin.for_this_thread(1.0)))
    t.start()
    t.join()
    assert seen == [0.0]


def test_wait_errors_say_who_waited_in_what_for_whom():
    """errors.peer_died and errors.timed_out, the one builder of the errors every
    backend raises when a wait fails."""
    from paratrain.comm.errors import CommTimeout, PeerError, peer_died, timed_out
    e = peer_died([(1, 42)], 0, "all_reduce(float32 x 4) over gloo", "Connection reset by peer")
    assert type(e) is PeerError and e.ranks == (1,)
    assert str(e) == ("rank 1 (pid 42) died or exited while rank 0 waited for it in all_reduce(float32 x 4) "
                      "over gloo (Connection reset by peer)")
    e = timed_out(2, 3, "recv of 8 bytes from rank 1 (tag 0)", [1], one_peer=True)
    assert isinstance(e, CommTimeout) and e.ranks == (1,)
    assert str(e) == ("rank 2 timed out after 3s in recv of 8 bytes from rank 1 (tag 0): rank 1 did not answer; "
                      "raise PARATRAIN_TIMEOUT if it is legitimately slow")
    e = timed_out(0, 300, "barrier", [1, 2], "alive, but not there")
    assert "waiting for ranks [1, 2] (alive, but not there). Ranks must call the same collectives" in str(e)
    assert str(timed_out(0, 1, "pt.init", [1], hint="")).endswith("waiting for ranks [1]")
