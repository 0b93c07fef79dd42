"""Parameter-server messages (ps/wire.py) and placement (ps/sharding.py): round trips,
every refusal with a message that says what to do, fuzzing, and the placement's promises."""
import dataclasses
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.comm.errors import FrameError
from paratrain.comm.ops import CODE_NUMPY
from paratrain.ps import sharding, wire
from paratrain.ps.sharding import Piece
from paratrain.ps.wire import HEADER, HEADER_SIZE, MAGIC, VERSION, Header, Op

LIMIT = 1 << 30
I32 = st.integers(-2**31, 2**31 - 1)
I64 = st.integers(-2**63, 2**63 - 1)


def test_header_is_64_bytes_and_ops_are_1_to_11():
    assert HEADER_SIZE == 64
    assert [int(o) for o in Op] == list(range(1, 12))   # 11: PUSH_PACKED (compressed pushes)


def _header(op, payload):
    """A header that is valid for ``op`` with ``payload`` (a float32 array or None)."""
    n = 0 if payload is None else payload.size
    flags = int(Op.PULL) if op in (Op.REPLY, Op.ERROR) else 0
    return Header(op, worker=3, key=2, clock=7, lo=5, hi=5 + n, dtype_code=0 if payload is None else 3,
                  flags=flags, token=wire.token_digest("s3cret"))


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("meta", [None, {}, {"optimizer": "adam", "hyper": {"lr": 1e-3}, "names": ["a", "b"]}])
@pytest.mark.parametrize("with_payload", [False, True])
def test_round_trip_every_op_zero_copy(op, meta, with_payload):
    payload = np.arange(1000, dtype=np.float32) if with_payload else None
    h = _header(op, payload)
    frames = wire.encode(h, meta, payload)
    assert len(frames) == 3 and len(frames[0]) == HEADER_SIZE
    if with_payload:
        assert frames[2] is payload  # handed to ZeroMQ as is, not copied
    else:
        assert frames[2] == b"" and frames[0][-16:-8] == bytes(8)  # payload_nbytes 0
    got, got_meta, got_payload = wire.decode(frames, max_payload=LIMIT, token=wire.token_digest("s3cret"))
    assert got == dataclasses.replace(h, payload_nbytes=0 if payload is None else payload.nbytes)
    assert isinstance(got.op, Op) and got.op is op
    assert got_meta == (meta or {})
    if with_payload:
        arr = wire.payload_array(got, got_payload)
        assert np.shares_memory(arr, payload)  # decode does not copy either
        assert np.array_equal(arr, payload)
    else:
        assert got_payload.nbytes == 0
        with pytest.raises(ValueError, match="carries no tensor"):
            wire.payload_array(got, got_payload)


def test_decode_accepts_zmq_frames_and_memoryviews_without_copying():
    zmq = pytest.importorskip("zmq")
    payload = np.arange(100_000, dtype=np.float64)  # above zmq.COPY_THRESHOLD: really zero-copy
    frames = wire.encode(Header(Op.PUSH, key=0, lo=0, hi=payload.size, dtype_code=4), {"k": 1}, payload)
    zframes = [zmq.Frame(f) for f in frames]
    h, meta, view = wire.decode([f.buffer for f in zframes], max_payload=LIMIT)
    assert h.payload_nbytes == payload.nbytes and meta == {"k": 1}
    assert np.shares_memory(wire.payload_array(h, view), payload)
    h2, _, _ = wire.decode(zframes, max_payload=LIMIT)
    assert h2 == h


@pytest.mark.parametrize("code,np_dtype", [(1, np.float16), (2, np.uint16), (3, np.float32), (4, np.float64),
                                           (5, np.int32), (6, np.int64), (7, np.uint8)])
def test_payload_array_has_the_dtype_of_the_code_bfloat16_as_uint16(code, np_dtype):
    data = np.arange(12).astype(np_dtype)
    h, _, view = wire.decode(wire.encode(Header(Op.PUSH, key=0, lo=0, hi=12, dtype_code=code), None, data), LIMIT)
    arr = wire.payload_array(h, view)
    assert arr.dtype == np_dtype and np.array_equal(arr, data)


def test_token_digest_and_env(monkeypatch):
    assert wire.token_digest(None) == wire.token_digest("") == bytes(8)
    d = wire.token_digest("abc")
    assert len(d) == 8 and d != bytes(8) and d == wire.token_digest("abc") != wire.token_digest("abd")
    monkeypatch.delenv("PARATRAIN_PS_TOKEN", raising=False)
    assert wire.token_from_env() is None
    monkeypatch.setenv("PARATRAIN_PS_TOKEN", "abc")
    assert wire.token_from_env() == d


# ---- every refusal ---------------------------------------------------------------------------


def _raw(magic=MAGIC, version=VERSION, op=2, worker=0, key=0, clock=0, lo=0, hi=4, code=3, flags=0, nbytes=16,
         token=bytes(8)):
    return HEADER.pack(magic, version, op, worker, key, clock, lo, hi, code, flags, nbytes, token)


GOOD_PAYLOAD = bytes(16)


@pytest.mark.parametrize("frames,words", [
    ([_raw(), b""], ["expected 3 frames", "got 2"]),
    ([b"id", _raw(), b"", GOOD_PAYLOAD], ["expected 3 frames", "identity"]),
    ([_raw()[:40], b"", GOOD_PAYLOAD], ["header frame is 40 bytes", "need 64"]),
    ([_raw() + b"x", b"", GOOD_PAYLOAD], ["header frame is 65 bytes"]),
    ([_raw(magic=b"HTTP"), b"", GOOD_PAYLOAD], ["bad magic", "PTPS"]),
    ([_raw(version=2), b"", GOOD_PAYLOAD], ["version 2", "same paratrain version"]),
    ([_raw(op=0), b"", GOOD_PAYLOAD], ["unknown op 0"]),
    ([_raw(op=12), b"", GOOD_PAYLOAD], ["unknown op 12"]),
    ([_raw(code=99), b"", GOOD_PAYLOAD], ["unknown dtype code 99"]),
    ([_raw(code=0), b"", GOOD_PAYLOAD], ["dtype code 0 means no payload"]),
    ([_raw(op=5, code=4, nbytes=12), b"", bytes(12)], ["not a multiple", "8-byte item size"]),
    ([_raw(nbytes=-4), b"", b""], ["negative"]),
    ([_raw(key=-2), b"", GOOD_PAYLOAD], ["key -2"]),
    ([_raw(lo=5, hi=4), b"", GOOD_PAYLOAD], ["range", "lo <= hi"]),
    ([_raw(lo=-1, hi=3), b"", GOOD_PAYLOAD], ["range", "0 <= lo"]),
    ([_raw(nbytes=16), b"", bytes(12)], ["payload frame is 12 bytes", "header says 16"]),
    ([_raw(nbytes=2**60, hi=2**58), b"", GOOD_PAYLOAD], ["larger than", "limit"]),
    ([_raw(hi=5), b"", GOOD_PAYLOAD], ["PUSH range [0, 5)", "needs 20 bytes"]),
    ([_raw(op=7, flags=3, lo=2, hi=3), b"", GOOD_PAYLOAD], ["REPLY range [2, 3)", "needs 4 bytes"]),
    ([_raw(), b"\xc1", GOOD_PAYLOAD], ["meta is not valid msgpack"]),
    ([_raw(), msgpack.packb([1, 2]), GOOD_PAYLOAD], ["msgpack map with str keys", "list"]),
    ([_raw(), msgpack.packb({b"k": 1}), GOOD_PAYLOAD], ["str keys"]),
    ([_raw(), msgpack.packb({1: 1}), GOOD_PAYLOAD], ["not valid msgpack"]),
    ([_raw(), msgpack.packb({"x": msgpack.ExtType(5, b"ab")}), GOOD_PAYLOAD], ["extension type"]),
    ([_raw(), msgpack.packb({"k": "x" * 5000}), GOOD_PAYLOAD], ["meta frame is", "limit"]),
    ([_raw(), b"\x91" * 3000, GOOD_PAYLOAD], ["not valid msgpack"]),  # nested deeper than msgpack allows
    ([_raw(), b"\xdd\xff\xff\xff\xff", GOOD_PAYLOAD], ["not valid msgpack"]),  # claims a 4G-element array
])
def test_each_bad_message_is_refused_saying_what_was_wrong(frames, words):
    with pytest.raises(FrameError) as e:
        wire.decode(frames, max_payload=LIMIT, max_meta=4096)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_range_rules_only_where_the_payload_is_the_range():
    # a PUSH_ROWS payload is rows listed in meta: not tied to [lo, hi)
    wire.decode([_raw(op=Op.PUSH_ROWS, hi=0), msgpack.packb({"rows": [1, 4]}), GOOD_PAYLOAD], LIMIT)
    # the reply to a PUSH echoes its range but carries no payload
    wire.decode([_raw(op=Op.REPLY, flags=Op.PUSH, lo=3, hi=900, code=0, nbytes=0), b"", b""], LIMIT)
    wire.decode([_raw(op=Op.PULL, lo=3, hi=900, code=0, nbytes=0), b"", b""], LIMIT)


def test_token_is_checked_when_expected():
    frames = [_raw(token=wire.token_digest("right")), b"", GOOD_PAYLOAD]
    wire.decode(frames, LIMIT, token=wire.token_digest("right"))
    wire.decode(frames, LIMIT, token=None)  # a server without a token accepts everyone
    with pytest.raises(FrameError, match="rejected: this server requires PARATRAIN_PS_TOKEN; set the same "
                                         "token on workers and servers"):
        wire.decode([_raw(), b"", GOOD_PAYLOAD], LIMIT, token=wire.token_digest("right"))
    with pytest.raises(FrameError, match="rejected: the token does not match.*same token on workers and servers"):
        wire.decode(frames, LIMIT, token=wire.token_digest("wrong"))


def test_encode_refuses_what_decode_would_refuse():
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="range"):
        wire.encode(Header(Op.PUSH, key=0, lo=0, hi=5, dtype_code=3), None, a)
    with pytest.raises(ValueError, match="dtype code 0 means no payload"):
        wire.encode(Header(Op.PUSH, key=0, lo=0, hi=4), None, a)
    with pytest.raises(ValueError, match="not contiguous"):
        wire.encode(Header(Op.PUSH_ROWS, dtype_code=3), None, np.zeros(8, np.float32)[::2])
    with pytest.raises(ValueError, match="token must be 8 bytes"):
        wire.encode(Header(Op.CLOCK, token=b"short"))
    with pytest.raises(ValueError, match="out of range"):
        wire.encode(Header(Op.CLOCK, worker=2**40))
    with pytest.raises(ValueError, match="meta must be a dict"):
        wire.encode(Header(Op.CLOCK), ["not", "a", "dict"])
    with pytest.raises(ValueError, match="unknown op"):
        wire.encode(Header(42))


# ---- fuzzing -----------------------------------------------------------------------------------


def _decode_or_frame_error(frames, max_payload=LIMIT):
    try:
        h, meta, payload = wire.decode(frames, max_payload=max_payload, max_meta=1 << 16)
    except FrameError:
        return None
    assert isinstance(meta, dict) and all(isinstance(k, str) for k in meta)
    assert payload.nbytes == h.payload_nbytes <= max_payload and 0 <= h.lo <= h.hi
    return h


@given(st.binary(max_size=80), st.binary(max_size=200), st.binary(max_size=64))
@settings(max_examples=400)
def test_arbitrary_frames_raise_only_frame_error(head, meta, payload):
    _decode_or_frame_error([head, meta, payload])


@given(st.binary(max_size=200), st.data())
@settings(max_examples=400)
def test_arbitrary_meta_behind_a_valid_header_raises_only_frame_error(meta, data):
    nbytes = data.draw(st.sampled_from([0, 8, 2**31, 2**60, 2**63 - 1]))
    head = _raw(op=data.draw(st.integers(1, 10)), code=data.draw(st.integers(0, 8)), nbytes=nbytes,
                hi=data.draw(st.sampled_from([0, 2, 2**58])), flags=data.draw(st.integers(0, 10)))
    _decode_or_frame_error([head, meta, bytes(data.draw(st.integers(0, 16)))])


@given(st.binary(min_size=64, max_size=64), st.data())
@settings(max_examples=300)
def test_corrupted_valid_header_raises_only_frame_error(noise, data):
    good = bytearray(_raw())
    i = data.draw(st.integers(0, 63))
    good[i:i + data.draw(st.integers(1, 8))] = noise[:8]
    _decode_or_frame_error([bytes(good[:64].ljust(64, b"\0")), b"", GOOD_PAYLOAD])


def test_huge_claimed_sizes_allocate_nothing():
    for n in (2**40, 2**60, 2**63 - 1):
        with pytest.raises(FrameError, match="larger than"):
            wire.decode([_raw(op=Op.PUSH_ROWS, code=7, nbytes=n), b"", b""], max_payload=LIMIT)


@st.composite
def valid_messages(draw):
    op = draw(st.sampled_from(list(Op)))
    code = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7]))
    n = 0 if code == 0 else draw(st.integers(0, 64))
    payload = None if code == 0 else np.zeros(n, CODE_NUMPY[code])
    lo = draw(st.integers(0, 2**62))
    flags = draw(st.integers(0, 2**16 - 1))
    ranged = code and (op == Op.PUSH or (op == Op.REPLY and flags == Op.PULL))
    hi = lo + n if ranged else draw(st.integers(lo, 2**63 - 1))
    h = Header(op, worker=draw(I32), key=draw(st.integers(-1, 2**31 - 1)), clock=draw(I64), lo=lo, hi=hi,
               dtype_code=code, flags=flags, token=draw(st.binary(min_size=8, max_size=8)))
    meta = draw(st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**64 - 1) | st.text() | st.floats(
        allow_nan=False) | st.lists(st.integers(0, 9), max_size=3), max_size=4))
    return h, meta, payload


@given(valid_messages())
@settings(max_examples=300)
def test_any_valid_header_round_trips_exactly(msg):
    h, meta, payload = msg
    frames = wire.encode(h, meta, payload)
    got, got_meta, got_payload = wire.decode(frames, max_payload=LIMIT, token=h.token)
    assert got == dataclasses.replace(h, payload_nbytes=0 if payload is None else payload.nbytes)
    assert got_meta == meta and bytes(got_payload) == (b"" if payload is None else payload.tobytes())
    assert struct.unpack_from("<4s", frames[0])[0] == MAGIC


# ---- sharding ------------------------------------------------------------------------------------

MODEL = [("embed", 3_000_001), ("fc.weight", 100_000), ("fc.bias", 10), ("ln.w", 512), ("ln.b", 512),
         ("empty", 0), ("mid", 262_145), ("head", 70_000), ("head.b", 10)]


def _check_cover(tensors, pieces):
    by_key = {}
    for p in pieces:
        assert p.name == tensors[p.key][0]
        by_key.setdefault(p.key, []).append((p.lo, p.hi))
    assert sorted(by_key) == list(range(len(tensors)))  # every tensor has a home
    for key, (_, numel) in enumerate(tensors):
        ranges = sorted(by_key[key])
        assert ranges[0][0] == 0 and ranges[-1][1] == numel  # covered from start to end...
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # ...exactly once


def _loads(pieces, servers, itemsize=4):
    load = [0] * servers
    for p in pieces:
        load[p.server] += (p.hi - p.lo) * itemsize
    return load


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_place_covers_splits_and_balances(servers):
    pieces = sharding.place(MODEL, servers)
    assert pieces == sharding.place(list(MODEL), servers)  # deterministic
    assert pieces == sorted(pieces, key=lambda p: (p.key, p.lo))
    _check_cover(MODEL, pieces)
    for key in (0, 6):  # the tensors of >= 1 MiB: one nearly equal range per server, in server order
        mine = [p for p in pieces if p.key == key]
        assert [p.server for p in mine] == list(range(servers))
        assert max(p.hi - p.lo for p in mine) - min(p.hi - p.lo for p in mine) <= 1
    for p in pieces:
        if p.key not in (0, 6):
            assert (p.lo, p.hi) == (0, MODEL[p.key][1])  # small tensors stay whole
    if servers == 1:
        assert {p.server for p in pieces} == {0} and len(pieces) == len(MODEL)


def test_small_tensors_go_largest_first_to_the_least_loaded_lowest_index():
    pieces = sharding.place([("a", 10), ("b", 30), ("c", 20), ("d", 20), ("e", 5)], 2)
    assert {p.name: p.server for p in pieces} == {"b": 0, "c": 1, "d": 1, "a": 0, "e": 0}


@given(st.lists(st.integers(0, 5000), max_size=40), st.integers(1, 7), st.lists(st.integers(0, 10**6), max_size=3))
@settings(max_examples=200)
def test_place_properties(small, servers, big):
    tensors = [(f"s{i}", n) for i, n in enumerate(small)] + [(f"b{i}", n) for i, n in enumerate(big)]
    pieces = sharding.place(tensors, servers, split_bytes=4 * 5001)
    _check_cover(tensors, pieces)
    assert pieces == sharding.place(tensors, servers, split_bytes=4 * 5001)
    largest_small = 4 * max((n for _, n in tensors if n < 5001), default=0)
    n_split = sum(n >= 5001 for _, n in tensors)
    load = _loads(pieces, servers)
    # LPT: no further apart than the largest small tensor (or than the one-element rounding of each split)
    assert max(load) - min(load) <= max(largest_small, 4 * n_split)
    if n_split == 0:
        assert max(load) - min(load) <= largest_small
    per = sharding.by_server(pieces, servers)
    assert len(per) == servers and sorted(sum(per, []), key=lambda p: (p.key, p.lo)) == pieces
    assert all(p.server == s for s, mine in enumerate(per) for p in mine)


def test_describe_mentions_every_server_and_marks_split_ranges():
    pieces = sharding.place(MODEL, 3)
    text = sharding.describe(pieces, 3)
    lines = text.splitlines()
    assert "3" in lines[0] and "9 tensors" in lines[0]
    for s in range(3):
        assert any(line.split()[0] == str(s) for line in lines[2:])
    assert "embed[0:1000000]" in text and "fc.weight" in text and "fc.weight[" not in text
    many = sharding.place([(f"t{i}", 1) for i in range(30)], 1)
    assert "+22 more" in sharding.describe(many, 1)
    print(text)


@pytest.mark.parametrize("args,words", [
    (([("a", 1)], 0), "servers must be >= 1"),
    (([("a", 1), ("a", 2)], 2), "names must be unique"),
    (([("a", -1)], 2), "numel -1"),
    (([(3, 1)], 2), "not a str"),
    (([("a", 1)], 2, 0), "split_bytes must be >= 1"),
])
def test_place_refuses_bad_input(args, words):
    with pytest.raises(ValueError, match=words):
        sharding.place(*args)


def test_by_server_refuses_a_piece_on_a_missing_server():
    with pytest.raises(ValueError, match="on server 4, but there are 2 servers"):
        sharding.by_server([Piece(0, "a", 4, 0, 1)], 2)


def test_frames_travel_through_a_real_socket_copy_false():
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://ps-wire-test")
        b.connect("inproc://ps-wire-test")
        grad = np.linspace(0, 1, 50_000, dtype=np.float32)
        a.send_multipart(wire.encode(Header(Op.PUSH, worker=1, key=3, lo=10, hi=10 + grad.size, dtype_code=3),
                                     {"step": 4}, grad), copy=False)
        a.send_multipart(wire.encode(Header(Op.CLOCK, worker=1)), copy=False)
        assert b.poll(5000)
        h, meta, payload = wire.decode([f.buffer for f in b.recv_multipart(copy=False)], max_payload=LIMIT)
        assert (h.op, h.key, h.lo, meta) == (Op.PUSH, 3, 10, {"step": 4})
        assert np.array_equal(wire.payload_array(h, payload), grad)
        assert b.poll(5000)
        h, meta, payload = wire.decode(b.recv_multipart(), max_payload=LIMIT)
        assert (h.op, meta, payload.nbytes) == (Op.CLOCK, {}, 0)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_doorbell_carries_steps_both_ways_and_drops_junk():
    """ps/doorbell.py: a rung record reaches the server as numbers, the answer comes back;
    junk on the bell is skipped without losing the records around it; a bell nobody reads
    any more (the server died) makes ring() fail, so the worker can fall back to ZeroMQ."""
    import os
    from paratrain.comm.shm import segment
    from paratrain.ps import doorbell
    server = doorbell.ServerBells(f"test-bells-{os.getpid()}", workers=2)
    worker = doorbell.WorkerBells(f"test-bells-{os.getpid()}", 1, 2)
    try:
        worker.ring(2, 3, 7, 42)
        assert server.rung() == [(1, 2, 3, 7, 42)]
        server.answer(1, 42)
        server.answer(1, 43)
        assert worker.answered() == [42, 43] and worker.answered() == []
        os.write(worker.ring_fd, b"\xff" * doorbell.RECORD.size)   # wrong magic
        assert server.rung() == []
        os.write(worker.ring_fd, doorbell.RECORD.pack(doorbell.MAGIC, 5, 2, 3, 0, 1))   # no worker 5
        assert server.rung() == []
        os.write(worker.ring_fd, b"\x11\xb3")   # half a record waits for the rest
        assert server.rung() == []
        os.write(worker.ring_fd, doorbell.RECORD.pack(doorbell.MAGIC, 0, 1, 1, 1, 2)[2:])
        assert server.rung() == [(0, 1, 1, 1, 2)]
        # junk of any length between records in one read: the records on both sides are kept
        worker.ring(2, 3, 9, 44)
        os.write(worker.ring_fd, b"\x07" * 13)
        os.write(worker.ring_fd, doorbell.RECORD.pack(doorbell.MAGIC, 7, 2, 3, 0, 1))   # no worker 7
        worker.ring(1, 0, 10, 45)
        assert server.rung() == [(1, 2, 3, 9, 44), (1, 1, 0, 10, 45)]
        assert server.partial == b""
    finally:
        server.close()
    assert not [n for n in segment.leftover_segments() if "test-bells" in n]
    with pytest.raises(BrokenPipeError):
        worker.ring(2, 3, 8, 43)
    worker.close()
