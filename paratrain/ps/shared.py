"""The same-host fast path: dense pushes and pulls through shared memory.

ZeroMQ over TCP loopback copies each byte twice in the kernel, besides the
framing in its I/O threads. When a worker and a server share a host, the tensor bytes need
not travel through a socket at all: the server maps one segment with two
regions per worker, and

- push: the worker copies its gradient into its *push* region and sends a
  header without payload; the server reads the gradient there (summing or
  applying it) before it replies, and the worker does not write the region
  again until that reply;
- pull: the server copies the shard into the worker's *pull* region and
  replies without payload; the worker copies it out before its next request.
  Under BSP the shards themselves live in the segment (its *values* region)
  and a pull copies nothing on the server: the weights change only when a
  round is complete, i.e. once every worker has pushed, and a worker pushes
  only after it has copied them out.

Each region belongs to one worker and is written by one side at a time, with
the ZeroMQ request/reply as the hand-over, so no read is torn. ZeroMQ still
carries every header (ordering, errors, the consistency rules are unchanged);
only the payload moves. BytePS does the same for servers co-located with
workers (Jiang et al., "A Unified Architecture for Accelerating Distributed
DNN Training in Heterogeneous GPU/CPU Clusters", OSDI 2020, sec. 6).

The worker decides: the server's registration reply names the segment and
its host; a worker on the same host (same hostname and boot id) that can map
it uses it. A restarted server has a new segment; a request naming the old
one is answered with an error asking for TCP, and the worker falls back.
The name is unlinked once every worker has used it (or at the server's exit;
the launcher sweeps ``/dev/shm/paratrain-<job>-*`` too).
"""
import itertools
import os

import numpy as np

from .. import config
from ..comm.env import host_id
from ..comm.shm import segment

FLAG_SHM = 1   # request header flags: the payload is in the shared segment
FLAG_STEP = 2  # a PUSH that also clocks and then pulls (the worker's whole step: Client.step)
FLAG_EXACT = 4  # (doorbell records only) a pull of the weights as they are, never predicted
_serial = itertools.count()   # several servers in one process (tests) get distinct names


class Regions:
    """A values region, then ``workers`` x (push, pull) regions, ``total`` float32 each."""

    def __init__(self, mm, workers, total):
        self.mm, self.workers, self.total = mm, workers, total
        self.array = np.frombuffer(mm, dtype=np.float32, count=(1 + 2 * workers) * total)

    def values(self, offset, n):
        return self.array[offset:offset + n]

    def push(self, worker, offset, n):
        at = (1 + 2 * worker) * self.total + offset
        return self.array[at:at + n]

    def pull(self, worker, offset, n):
        at = (2 + 2 * worker) * self.total + offset
        return self.array[at:at + n]

    @staticmethod
    def nbytes(workers, total):
        return max(4, (1 + 2 * workers) * total * 4)


class ServerRegions(Regions):
    """The server's segment; its name is removed once every worker has used it."""

    def __init__(self, index, workers, total):
        job = config.get("PARATRAIN_JOB_ID") or "ps"
        self.name = f"{job}-ps{index}-{os.getpid()}-{next(_serial)}"
        self.path, mm = segment.create(self.name, self.nbytes(workers, total))
        super().__init__(mm, workers, total)
        self.users = set()

    def used_by(self, worker):
        """Returns True once every worker has used the segment (its name is then gone)."""
        self.users.add(worker)
        if len(self.users) == self.workers and self.path:
            segment.unlink(self.path)   # every worker has it mapped: nothing can leak any more
            self.path = None
        return self.path is None

    def describe(self):
        return {"name": self.name, "host": host_id(), "total": self.total}


def attach(info, workers):
    """The worker's view of a server's segment, or None when it is on another host
    or cannot be mapped (then the worker uses TCP)."""
    if not info or info.get("host") != host_id():
        return None
    try:
        mm = segment.attach(info["name"], Regions.nbytes(workers, int(info["total"])))
    except (OSError, ValueError):
        return None
    regions = Regions(mm, workers, int(info["total"]))
    regions.name = info["name"]
    return regions
