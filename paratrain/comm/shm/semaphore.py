"""Process-shared POSIX semaphores living inside a shared-memory segment.

Why semaphores: a waiting rank must *sleep*, not spin, because four workers on
two cores would otherwise steal each other's CPU. ``sem_timedwait`` sleeps in
the kernel (a futex) and wakes when a peer calls ``sem_post``; an uncontended
post or wait never leaves user space. We call glibc through ctypes, so no
compiled extension of our own is needed.

A wait first spins briefly (a wake-up through the kernel costs many times a
short spin; comm/spin.py says how long), then sleeps in short slices so that
the caller can notice a dead peer or a Ctrl-C between slices, and never waits
past its deadline.

The spin *reads* the semaphore's count with a plain load and only calls
``sem_trywait`` once it is non-zero ("test and test-and-set"): spinning on
``sem_trywait`` itself, an atomic compare-and-swap, keeps stealing the cache
line from the poster, which slows the round trip by orders of magnitude.
glibc keeps the count in the low 32 bits of the sem_t's first word on 64-bit
targets (nptl's struct new_sem); ``_probe_count_layout`` verifies that on a
private semaphore at import and, if not, we spin on trywait.
"""
import ctypes
import errno
import os
import time

_libc = ctypes.CDLL(None, use_errno=True)
SEM_SIZE = 32  # sizeof(sem_t) on 64-bit Linux (x86_64 and aarch64)
SEM_STRIDE = 64  # one cache line each: no false sharing between ranks' semaphores


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_sem_init = _libc.sem_init
_sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_sem_post = _libc.sem_post
_sem_post.argtypes = [ctypes.c_void_p]
_sem_trywait = _libc.sem_trywait
_sem_trywait.argtypes = [ctypes.c_void_p]
_sem_timedwait = _libc.sem_timedwait
_sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
_sem_getvalue = _libc.sem_getvalue
_sem_getvalue.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]

SLICE = 0.05  # seconds a blocking wait sleeps before checking on its peers


class Semaphore:
    """One sem_t at a fixed address inside a mapped segment.

    count: an optional numpy uint32 view of the sem_t's first 4 bytes, for spinning on plain loads."""

    __slots__ = ("addr", "count")

    def __init__(self, addr, count=None):
        self.addr = addr
        self.count = count if COUNT_IS_FIRST_WORD else None

    def init(self, value):
        if _sem_init(self.addr, 1, value) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def post(self):
        if _sem_post(self.addr) != 0:
            raise OSError(ctypes.get_errno(), "sem_post failed")

    def value(self):
        v = ctypes.c_int()
        _sem_getvalue(self.addr, ctypes.byref(v))
        return v.value

    def spin_acquire(self, spin_s):
        """Take one unit if it is there or arrives within spin_s; False if not (nothing taken)."""
        addr = self.addr
        if _sem_trywait(addr) == 0:
            return True
        if spin_s > 0:
            count, clock = self.count, time.perf_counter
            end = clock() + spin_s
            while clock() < end:
                if count is not None:
                    while count[0] == 0 and clock() < end:
                        pass
                if _sem_trywait(addr) == 0:
                    return True
        return False

    def acquire(self, spin_s, deadline, on_slice):
        """Take one unit; spin up to spin_s, then sleep in slices.

        on_slice() is called after every slice that ended without the unit; it
        raises to abort the wait (a dead peer, the deadline passed).
        """
        if self.spin_acquire(spin_s):
            return
        addr = self.addr
        ts = _Timespec()
        while True:
            wake = min(time.time() + SLICE, deadline)
            ts.tv_sec = int(wake)
            ts.tv_nsec = int((wake - int(wake)) * 1e9)
            if _sem_timedwait(addr, ctypes.byref(ts)) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.ETIMEDOUT, errno.EINTR, errno.EAGAIN):
                raise OSError(err, os.strerror(err))
            on_slice()


def _probe_count_layout():
    """Does the sem_t's first 32-bit word hold its count (little-endian glibc, 64-bit)?"""
    import mmap

    import numpy as np
    buf = mmap.mmap(-1, SEM_STRIDE)
    word = np.frombuffer(buf, dtype=np.uint32, count=1)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if _sem_init(addr, 1, 0) != 0:
        return False
    seen = []
    for _ in range(3):
        _sem_post(addr)
        seen.append(int(word[0]))
    v = ctypes.c_int()
    _sem_getvalue(addr, ctypes.byref(v))
    del word
    return seen == [1, 2, 3] and v.value == 3


COUNT_IS_FIRST_WORD = _probe_count_layout()
