"""The messages between parameter-server workers and servers, over ZeroMQ.

Every message is exactly three ZeroMQ frames, ``[header, meta, payload]``.
ZeroMQ delivers a multipart message whole or not at all, so the frames need
no length prefixes of their own; keeping the tensor bytes in a frame of their
own lets them go out straight from parameter or gradient memory
(``send_multipart(frames, copy=False)``), as ps-lite sends its SArray values
(Li et al., "Scaling Distributed Machine Learning with the Parameter Server",
OSDI 2014, section 4).

- header: 64 bytes, little-endian, fixed (below). Checked field by field before
  anything else is looked at, so a stray or hostile peer gets a FrameError,
  never an allocation or a crash (the same rule as ``paratrain.comm.wire``).
- meta: a msgpack map with str keys, or empty; small structured things
  (optimizer and hyper-parameters, tensor pieces at registration, error
  messages, statistics). msgpack builds only plain data and never runs code;
  nothing is pickled.
- payload: raw tensor bytes, or empty; dtype from ``paratrain.comm.ops`` codes.

    offset size field
    0      4    magic           b"PTPS"
    4      2    version         1
    6      2    op              Op
    8      4    worker          sender's worker rank (-1: none)
    12     4    key             tensor index, or -1
    16     8    clock           the sender's clock (its step)
    24     8    lo              first element of the range
    32     8    hi              one past the last element of the range
    40     2    dtype code      paratrain.comm.ops code; 0 = no payload
    42     2    flags           REPLY / ERROR: the op being answered
    44     4    (zero padding, so every 8-byte field is 8-byte aligned)
    48     8    payload_nbytes
    56     8    token           first 8 bytes of sha256(PARATRAIN_PS_TOKEN), or zeros

Ranges: PUSH and PULL name elements [lo, hi) of the flattened tensor ``key``
(a compressed PUSH or PUSH_PACKED of key -1: [0, hi) of every shard the
server holds, concatenated in its order); REPLY and ERROR echo the range of
the request they answer. A PUSH with a dtype and a REPLY to a PULL (flags ==
PULL) with a dtype carry exactly hi - lo elements, and decode checks it.
PUSH_ROWS / PULL_ROWS list their rows in meta, so their payload is not tied
to [lo, hi); nor is a PUSH_PACKED's (a compressed gradient of [lo, hi), its
codec named in meta: push_codecs.py, which checks its size); the other ops
send lo = hi = 0. For every op, 0 <= lo <= hi.

The token keeps one job's workers off another job's servers on a shared
network; it travels in the clear and is no substitute for a private network.
"""
import dataclasses
import enum
import hashlib
import hmac
import struct

import msgpack
import numpy as np

from .. import config
from ..comm.errors import FrameError
from ..comm.ops import CODE_NUMPY

MAGIC = b"PTPS"
VERSION = 1
HEADER = struct.Struct("<4sHHiiqqqHH4xq8s")
HEADER_SIZE = HEADER.size  # 64
NO_TOKEN = bytes(8)
MAX_META = 1 << 22   # a registration of ~100k tensor pieces fits; a hostile map cannot balloon
TOKEN_ENV = "PARATRAIN_PS_TOKEN"
_ITEMSIZE = {c: np.dtype(n).itemsize for c, n in CODE_NUMPY.items()}


class Op(enum.IntEnum):
    REGISTER = 1
    PUSH = 2
    PULL = 3
    CLOCK = 4
    PUSH_ROWS = 5
    PULL_ROWS = 6
    REPLY = 7
    ERROR = 8
    STATS = 9
    SHUTDOWN = 10
    PUSH_PACKED = 11   # a compressed push of [lo, hi) (key -1: every shard): codec in meta, bytes in the payload


_OPS = frozenset(int(o) for o in Op)


@dataclasses.dataclass(frozen=True)
class Header:
    """The 64-byte header as fields (layout in the module docstring)."""
    op: Op
    worker: int = -1
    key: int = -1
    clock: int = 0
    lo: int = 0
    hi: int = 0
    dtype_code: int = 0
    flags: int = 0
    payload_nbytes: int = 0
    token: bytes = NO_TOKEN


def token_digest(secret):
    """The 8 bytes a header carries for ``secret``: sha256's first 8 bytes, or zeros when unset."""
    return hashlib.sha256(secret.encode()).digest()[:8] if secret else NO_TOKEN


def token_from_env():
    """The digest of ``$PARATRAIN_PS_TOKEN``, or None when it is unset (then no token is checked)."""
    secret = config.get(TOKEN_ENV)
    return token_digest(secret) if secret else None


def _check(h):
    """Why the header fields are inconsistent (a sentence), or None when they are fine."""
    if h.op not in _OPS:
        return f"unknown op {h.op} (known: 1..{len(Op)}): mixed paratrain versions?"
    if h.dtype_code != 0 and h.dtype_code not in _ITEMSIZE:
        return f"unknown dtype code {h.dtype_code} (known: 0 for no payload, {sorted(_ITEMSIZE)})"
    if h.key < -1:
        return f"key {h.key} is negative; a tensor index is >= 0, or -1 for none"
    if h.lo < 0 or h.hi < h.lo:
        return f"bad element range lo={h.lo}, hi={h.hi}: need 0 <= lo <= hi"
    if h.payload_nbytes < 0:
        return f"payload_nbytes {h.payload_nbytes} is negative"
    if h.dtype_code == 0:
        if h.payload_nbytes:
            return f"dtype code 0 means no payload, but payload_nbytes is {h.payload_nbytes}: set a dtype code"
        return None
    size = _ITEMSIZE[h.dtype_code]
    if h.payload_nbytes % size:
        return (f"payload of {h.payload_nbytes} bytes is not a multiple of the {size}-byte item size "
                f"of dtype code {h.dtype_code}: truncated or wrong dtype")
    if h.op == Op.PUSH or (h.op == Op.REPLY and h.flags == Op.PULL):
        if (h.hi - h.lo) * size != h.payload_nbytes:
            return (f"{Op(h.op).name} range [{h.lo}, {h.hi}) needs {(h.hi - h.lo) * size} bytes of "
                    f"dtype code {h.dtype_code}, but payload_nbytes is {h.payload_nbytes}")
    return None


def encode(header, meta=None, payload=None):
    """The frames of one message: ``[header bytes, meta bytes, payload]``.

    payload is any C-contiguous buffer (bytes, memoryview, numpy array; for a
    torch tensor pass ``t.numpy()``) and is returned as is, not copied, for
    ``send_multipart(frames, copy=False)``. Zero-copy means the memory must not
    change until ZeroMQ has sent it (pass a copy, or ``track=True`` and wait):
    pyzmq copies frames under ``zmq.COPY_THRESHOLD`` (64 KiB) but sends larger
    ones later, from its I/O thread. payload_nbytes is computed here. An
    inconsistent header is refused with ValueError rather than sent.
    """
    if payload is None:
        payload, nbytes = b"", 0
    else:
        view = memoryview(payload)
        if not view.c_contiguous:
            raise ValueError("payload is not contiguous; pass a contiguous copy (np.ascontiguousarray)")
        nbytes = view.nbytes
    h = dataclasses.replace(header, payload_nbytes=nbytes)
    problem = _check(h)
    if problem is None and len(h.token) != 8:
        problem = f"token must be 8 bytes (token_digest), not {len(h.token)}"
    if problem:
        raise ValueError(f"refusing to send an invalid message: {problem}")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"meta must be a dict with str keys, not {type(meta).__name__}")
    try:
        head = HEADER.pack(MAGIC, VERSION, h.op, h.worker, h.key, h.clock, h.lo, h.hi,
                           h.dtype_code, h.flags, h.payload_nbytes, h.token)
    except struct.error as e:
        raise ValueError(f"refusing to send an invalid message: a header field is out of range ({e})") from None
    return [head, msgpack.packb(meta, use_bin_type=True) if meta else b"", payload]


def _no_ext(code, data):
    raise FrameError(f"meta holds a msgpack extension type {code}; meta carries plain data only")


def decode(frames, max_payload, token=None, max_meta=MAX_META):
    """Parse and validate one message; return ``(Header, meta dict, payload memoryview)``.

    frames: the three frames as bytes, memoryviews or zmq.Frames (no ROUTER
    identity). max_payload: the largest payload accepted, in bytes. token: the
    8-byte digest every message must carry (token_from_env()), or None to accept
    any. Every length is checked against the header and the limits before the
    meta is parsed or the payload trusted; the payload is not copied. Raises
    FrameError saying what was wrong.
    """
    if len(frames) != 3:
        raise FrameError(f"expected 3 frames [header, meta, payload], got {len(frames)}: not a paratrain "
                         "parameter-server message (on a ROUTER socket, strip the identity frame first)")
    head, meta_frame, payload = (memoryview(f) for f in frames)
    if head.nbytes != HEADER_SIZE:
        raise FrameError(f"header frame is {head.nbytes} bytes, need {HEADER_SIZE}: not a paratrain "
                         "parameter-server message")
    magic, version, *fields = HEADER.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r} (expected {MAGIC!r}): something other than a paratrain "
                         "parameter-server peer is talking to this port")
    if version != VERSION:
        raise FrameError(f"message version {version}, this paratrain speaks {VERSION}: "
                         "run the same paratrain version on workers and servers")
    h = Header(*fields)
    if token is not None and not hmac.compare_digest(h.token, token):
        what = "this server requires PARATRAIN_PS_TOKEN" if h.token == NO_TOKEN else \
            "the token does not match this server's PARATRAIN_PS_TOKEN"
        raise FrameError(f"rejected: {what}; set the same token on workers and servers")
    problem = _check(h)
    if problem:
        raise FrameError(problem)
    if h.payload_nbytes > max_payload:
        raise FrameError(f"payload of {h.payload_nbytes} bytes is larger than the {max_payload}-byte limit: "
                         "split the tensor (sharding.place split_bytes) or raise the limit")
    if payload.nbytes != h.payload_nbytes:
        raise FrameError(f"payload frame is {payload.nbytes} bytes but the header says {h.payload_nbytes}: "
                         "truncated or corrupted message")
    if meta_frame.nbytes > max_meta:
        raise FrameError(f"meta frame is {meta_frame.nbytes} bytes, more than the {max_meta}-byte limit: "
                         "send tensors as payload, not inside meta")
    meta = {}
    if meta_frame.nbytes:
        try:  # unpackb caps every string, array and map length at the frame's own length
            meta = msgpack.unpackb(meta_frame, raw=False, strict_map_key=True, ext_hook=_no_ext)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise FrameError(f"meta is not valid msgpack ({type(e).__name__}: {e})") from None
        if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
            raise FrameError(f"meta must be a msgpack map with str keys, got {type(meta).__name__}")
    return dataclasses.replace(h, op=Op(h.op)), meta, payload.cast("B")


def payload_array(header, payload):
    """The payload as a flat numpy array of the header's dtype, sharing its memory
    (read-only when the frame is; bfloat16 comes as uint16 bits, as in comm/ops)."""
    if header.dtype_code not in CODE_NUMPY:
        raise ValueError(f"message op {header.op!r} carries no tensor (dtype code {header.dtype_code})")
    return np.frombuffer(payload, dtype=CODE_NUMPY[header.dtype_code])


MAX_ROWS = MAX_META // 8 - 64   # row ids one message can carry in its meta


def rows_meta(rows, **extra):
    """The meta of a PUSH_ROWS / PULL_ROWS: the row ids as raw little-endian int64
    bytes (a msgpack bin, parsed without a per-id cost), plus ``extra``."""
    rows = np.ascontiguousarray(rows, dtype="<i8")
    if rows.ndim != 1 or rows.size > MAX_ROWS:
        raise ValueError(f"a message carries a 1-d list of at most {MAX_ROWS} row ids, not shape {rows.shape}")
    return dict(extra, rows=rows.tobytes())


def rows_from_meta(meta, header, dim=None):
    """The row ids of a PUSH_ROWS / PULL_ROWS as int64, checked against the payload:
    a PUSH_ROWS carries exactly len(rows) x dim float32 values. Raises FrameError."""
    raw = meta.get("rows", b"")
    if not isinstance(raw, bytes) or len(raw) % 8:
        raise FrameError(f"meta 'rows' must be raw int64 bytes (a multiple of 8), got {type(raw).__name__} "
                         f"of {len(raw) if isinstance(raw, bytes) else '?'} bytes")
    rows = np.frombuffer(raw, dtype="<i8")
    if header.op == Op.PUSH_ROWS and dim is not None:
        want = rows.size * dim * 4
        if header.dtype_code != 3 and rows.size:
            raise FrameError(f"PUSH_ROWS carries float32 gradients (dtype code 3), not code {header.dtype_code}")
        if header.payload_nbytes != want:
            raise FrameError(f"PUSH_ROWS of {rows.size} rows of width {dim} needs {want} bytes of float32, "
                             f"got {header.payload_nbytes}")
    return rows
