"""Tensors that live in a group's shared memory, so collectives on them skip the copy-in.

A collective over private memory starts by copying each rank's input into
shared memory (the direct algorithm's copy-in) and ends by copying results out.
When the tensor *already* lives in shared memory, where every rank of the host
can read it, neither copy is needed: each rank reduces its slice reading the
others' tensors where they lie, and fetches the other slices straight from
their owners (shm/resident.py). Data parallelism allocates its gradient
buckets this way and lets the gradients themselves be views into them, as
PyTorch DDP's ``gradient_as_bucket_view`` does (Li et al., "PyTorch
Distributed", VLDB 2020, arXiv 2006.15704, section 4.2), so backward writes
gradients straight into memory the other ranks can read.

``g.empty_shared(numel, dtype)`` is collective: every rank of the group calls it
in the same order with the same size. It maps one segment of P parts, one per
rank (each rank writes only its own), and returns this rank's part. Like the
group's own segment, the name is unlinked as soon as every rank has mapped it,
so nothing is left in /dev/shm after a crash.
"""
import bisect
from datetime import timedelta

import numpy as np

from .. import ops
from . import segment

PAGE = 4096


class SharedRegion:
    """One allocation: P equal parts, ``parts[q]`` being rank q's (uint8 views)."""

    def __init__(self, index, mm, part_bytes, P, me):
        raw = np.frombuffer(mm, dtype=np.uint8)
        self.index = index
        self.part_bytes = part_bytes
        self.parts = [raw[q * part_bytes:(q + 1) * part_bytes] for q in range(P)]
        self.lo = self.parts[me].ctypes.data
        self.hi = self.lo + part_bytes

    def views(self, offset, numel, dtype):
        """The same element range of every rank's part, as arrays of ``dtype``."""
        nbytes = numel * np.dtype(dtype).itemsize
        return [p[offset:offset + nbytes].view(dtype) for p in self.parts]


class SharedBuffers:
    """The shared allocations of one ShmGroup, and the lookup that tells a
    collective whether its buffer is one of them."""

    def __init__(self, store, key, rank, ranks, timeout):
        """The group's rendezvous store and key, this rank, every member's global rank."""
        self._store, self._key, self._rank, self._ranks, self._timeout = store, key, rank, ranks, timeout
        self._regions = []  # in allocation order: region.index is the position here
        self._by_address = []  # this rank's parts sorted by address, for a bisect per call
        self._starts = []

    def allocate(self, numel, dtype):
        code = ops.DTYPE_CODE.get(dtype)
        if code is None:
            raise TypeError(f"empty_shared: dtype {dtype} is not supported; use one of {ops.supported_dtypes()}")
        numel = int(numel)
        if numel < 0:
            raise ValueError(f"empty_shared: numel must be >= 0, got {numel}")
        np_dtype = ops.CODE_NUMPY[code]
        nbytes = numel * np.dtype(np_dtype).itemsize
        part = max(PAGE, -(-nbytes // PAGE) * PAGE)
        index = len(self._regions)
        P, me = len(self._ranks), self._rank
        mm = segment.open_shared(self._store, f"{self._key}/shared{index}", me, self._ranks, part * P,
                                 timedelta(seconds=self._timeout))
        region = SharedRegion(index, mm, part, P, me)
        self._regions.append(region)
        at = bisect.bisect(self._starts, region.lo)
        self._starts.insert(at, region.lo)
        self._by_address.insert(at, region)
        return ops.torch_view(region.parts[me][:nbytes].view(np_dtype), code)

    def locate(self, buf):
        """(region, byte offset) if the flat buffer, or a list of pieces that follow one
        another in memory, lies inside this rank's part of a shared allocation; else None."""
        if not self._regions:
            return None
        if isinstance(buf, list):
            if not ops.end_to_end(buf):
                return None
            addr, nbytes = ops.address(buf[0]), sum(p.nbytes for p in buf)
        else:
            addr, nbytes = ops.address(buf), buf.nbytes
        at = bisect.bisect(self._starts, addr) - 1  # the last part starting at or before addr
        if at >= 0:
            region = self._by_address[at]
            if addr + nbytes <= region.hi:
                return region, addr - region.lo
        return None

    def placement(self, buf):
        """A number that ranks compare in the collective's descriptor: where the buffer
        lives (0: private memory), so ranks that disagree fail loudly instead of
        taking different code paths."""
        loc = self.locate(buf)
        if loc is None:
            return 0
        region, offset = loc
        return ((region.index + 1) << 40) | offset

    def decode(self, placement):
        """(region, byte offset) back from ``placement``'s number (None for 0), so a
        collective looks its buffer up once per call, in the descriptor."""
        if not placement:
            return None
        return self._regions[(placement >> 40) - 1], placement & ((1 << 40) - 1)

