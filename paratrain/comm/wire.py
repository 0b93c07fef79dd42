"""The fixed header in front of every chunk a rank reads from another.

Nothing a peer wrote is unpickled: a chunk is this 32-byte header followed by
raw element bytes. The reader checks the magic number, the version and every
length against limits it already knows *before* touching the payload, so a
corrupt or hostile frame is an error, never an allocation or a crash.

    offset size field
    0      4    magic   b"PTF1"
    4      2    version
    6      2    dtype code (paratrain.comm.ops)
    8      4    tag
    12     4    sequence number of the message on this channel
    16     8    total bytes of the message
    24     4    offset of this chunk in the message, in units of chunk capacity
    28     4    bytes of payload in this chunk
"""
import struct

from .errors import FrameError
from .ops import CODE_TORCH

MAGIC = b"PTF1"
VERSION = 1
HEADER = struct.Struct("<4sHHiIQII")
HEADER_SIZE = HEADER.size  # 32


def encode_header(buf, offset, *, code, tag, seq, total, index, length):
    HEADER.pack_into(buf, offset, MAGIC, VERSION, code, tag, seq & 0xFFFFFFFF, total, index, length)


def decode_header(data, *, capacity, max_total):
    """Parse and validate a header; return (code, tag, seq, total, index, length).

    capacity: the most payload one chunk may carry; max_total: the largest
    message the reader is prepared to accept. Raises FrameError naming the bad field.
    """
    if len(data) < HEADER_SIZE:
        raise FrameError(f"frame header truncated: {len(data)} bytes, need {HEADER_SIZE}")
    magic, version, code, tag, seq, total, index, length = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {magic!r} (expected {MAGIC!r}): memory corrupted or not a paratrain peer")
    if version != VERSION:
        raise FrameError(f"frame version {version}, this paratrain speaks {VERSION}: mixed paratrain versions?")
    if code not in CODE_TORCH:
        raise FrameError(f"frame dtype code {code} is not one paratrain knows")
    if total > max_total:
        raise FrameError(f"frame announces a {total}-byte message, more than the {max_total} bytes expected")
    if length > capacity:
        raise FrameError(f"frame chunk of {length} bytes exceeds the {capacity}-byte chunk capacity")
    if index * capacity + length > total:
        raise FrameError(f"frame chunk {index} of {length} bytes runs past the {total}-byte message")
    return code, tag, seq, total, index, length
