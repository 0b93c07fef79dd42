"""The frame header: decoding arbitrary bytes never crashes or over-allocates."""
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.comm.errors import FrameError
from paratrain.comm.ops import CODE_TORCH
from paratrain.comm.wire import HEADER, HEADER_SIZE, MAGIC, VERSION, decode_header, encode_header

CAP = 1 << 20
MAX_TOTAL = 1 << 30


@given(st.binary(min_size=0, max_size=64))
@settings(max_examples=500)
def test_random_bytes_either_decode_within_limits_or_raise_frame_error(data):
    try:
        code, tag, seq, total, index, length = decode_header(data, capacity=CAP, max_total=MAX_TOTAL)
    except FrameError:
        return
    assert total <= MAX_TOTAL and length <= CAP and index * CAP + length <= total


@given(st.binary(min_size=HEADER_SIZE - 6, max_size=HEADER_SIZE + 8))
@settings(max_examples=1000)
def test_random_fields_behind_a_valid_magic_and_version_decode_within_limits_or_raise(rest):
    """The same, past the first check: random bytes behind a real magic and version
    reach every later field's check (the plain random case almost never gets there)."""
    data = HEADER.pack(MAGIC, VERSION, 0, 0, 0, 0, 0, 0)[:6] + rest
    try:
        code, tag, seq, total, index, length = decode_header(data, capacity=CAP, max_total=MAX_TOTAL)
    except FrameError:
        return
    assert code in CODE_TORCH and total <= MAX_TOTAL and length <= CAP and index * CAP + length <= total


@given(st.integers(1, 7), st.integers(-2**31, 2**31 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, MAX_TOTAL), st.data())
def test_roundtrip(code, tag, seq, total, data):
    index = data.draw(st.integers(0, max(0, (total - 1) // CAP)))
    length = min(CAP, total - index * CAP)
    buf = bytearray(HEADER_SIZE)
    encode_header(buf, 0, code=code, tag=tag, seq=seq, total=total, index=index, length=length)
    assert decode_header(bytes(buf), capacity=CAP, max_total=MAX_TOTAL) == (code, tag, seq, total, index, length)


@given(st.sampled_from(["magic", "version", "code", "total", "length", "past_end"]), st.integers(1, 2**20))
def test_each_corruption_names_its_field(field, junk):
    vals = dict(magic=MAGIC, version=VERSION, code=3, tag=0, seq=0, total=4 * CAP, index=1, length=CAP)
    words = {"magic": "magic", "version": "version", "code": "dtype code", "total": "expected",
             "length": "capacity", "past_end": "runs past"}
    if field == "magic":
        vals["magic"] = struct.pack("<I", junk)[:4] if struct.pack("<I", junk) != MAGIC else b"XXXX"
    elif field == "version":
        vals["version"] = VERSION + 1 + junk % 1000   # never VERSION itself
    elif field == "code":
        vals["code"] = 8 + junk % 1000
    elif field == "total":
        vals["total"] = MAX_TOTAL + junk
    elif field == "length":
        vals["length"] = CAP + junk
    else:
        vals["index"] = 4 + junk
    data = HEADER.pack(vals["magic"], vals["version"], vals["code"], vals["tag"], vals["seq"], vals["total"],
                       vals["index"], vals["length"])
    with pytest.raises(FrameError, match=words[field]):
        decode_header(data, capacity=CAP, max_total=MAX_TOTAL)


def test_truncated_header():
    with pytest.raises(FrameError, match="truncated"):
        decode_header(b"PTF1", capacity=CAP, max_total=MAX_TOTAL)
