"""A named shared-memory segment that cannot outlive the job.

Rank 0 creates ``/dev/shm/paratrain-<job>-<n>``, every rank maps it, and once
all ranks report (through the rendezvous store) that they have mapped it,
rank 0 unlinks the name. From then on the memory lives exactly as long as
some process still maps it: a crash, a kill -9 or Ctrl-C can leave nothing
behind in /dev/shm. The name only exists during the few milliseconds of set-up,
and an ``atexit`` hook removes it if set-up itself fails.

We use os/mmap directly rather than ``multiprocessing.shared_memory`` because
the latter's resource tracker unlinks segments it did not create and warns at
exit about segments that are in use by other processes.
"""
import atexit
import mmap
import os

from ... import config
from ..rendezvous import wait_keys

SHM_DIR = "/dev/shm"
PREFIX = "paratrain-"
_pending_unlink = set()


def _cleanup():
    for path in list(_pending_unlink):
        unlink(path)


atexit.register(_cleanup)


def create(name, size):
    """Create and map a new segment of ``size`` bytes (zero-filled)."""
    path = path_of(name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        raise FileExistsError(f"shared-memory segment {path} already exists: another job with the same id "
                              f"is running, or remove the stale file") from None
    _pending_unlink.add(path)
    try:
        os.ftruncate(fd, size)
        return path, mmap.mmap(fd, size)
    finally:
        os.close(fd)


def path_of(name):
    return os.path.join(SHM_DIR, PREFIX + name)


def create_fifo(name):
    """A named pipe beside the segments (ps/doorbell.py), owner-only, removed at exit
    like them if nobody unlinks it first. Returns its path."""
    path = path_of(name)
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:
        raise FileExistsError(f"{path} already exists: another job with the same id is running, "
                              f"or remove the stale file") from None
    _pending_unlink.add(path)
    return path


def attach(name, size):
    """Map a segment another rank created; checks its size first."""
    path = path_of(name)
    fd = os.open(path, os.O_RDWR)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ValueError(f"shared-memory segment {path} is {actual} bytes, expected {size}: "
                             "ranks disagree on the group's configuration")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unlink(path):
    _pending_unlink.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def leftover_segments():
    """Names of paratrain segments still in /dev/shm (tests check this is empty)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def open_shared(store, key, rank, ranks, size, wait, prepare=None):
    """Create (rank 0) or attach (the others) the segment of group ``key``; every rank
    of the group calls it with the same size. Returns the mmap.

    Rank 0 creates it, calls ``prepare(mm)`` (to write headers or initialise
    semaphores before anyone else can see them) and publishes the name through
    the rendezvous store; the others attach; once every rank says it has mapped
    it, rank 0 unlinks the name, so from then on nothing can leak. ``wait`` is
    a timedelta: how long to wait for the others.
    """
    import secrets
    P = len(ranks)
    if rank == 0:
        name = f"{config.get('PARATRAIN_JOB_ID') or 'job'}-{key.replace('/', '_')}-{os.getpid()}-{secrets.token_hex(4)}"
        path, mm = create(name, size)
        if prepare is not None:
            prepare(mm)
        store.set(f"{key}/segment", name)
    else:
        _wait(store, [f"{key}/segment"], [ranks[0]], ranks[rank], wait)
        mm = attach(store.get(f"{key}/segment").decode(), size)
    store.set(f"{key}/attached/{rank}", "1")
    if rank == 0:
        try:
            _wait(store, [f"{key}/attached/{r}" for r in range(P)], ranks, ranks[rank], wait)
        finally:
            unlink(path)
    return mm


def _wait(store, keys, owners, me, wait):
    wait_keys(store, keys, owners, me, wait.total_seconds(), "the set-up of a group's shared memory")
