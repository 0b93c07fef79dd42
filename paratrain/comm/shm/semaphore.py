"""Process-shared POSIX semaphores living inside a shared-memory segment.

Why semaphores: a waiting rank must *sleep*, not spin, because four workers on
two cores would otherwise steal each other's CPU. ``sem_timedwait`` sleeps in
the kernel (a futex) and wakes when a peer calls ``sem_post``; an uncontended
post or wait never leaves user space. We call glibc through ctypes, so no
compiled extension of our own is needed.

A wait first spins briefly with ``sem_trywait`` (a wake-up through the kernel
costs ~30 us on a VM, a spin ~2 us), then sleeps in short slices so that the
caller can notice a dead peer or a Ctrl-C between slices, and never waits
past its deadline.
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
    """One sem_t at a fixed address inside a mapped segment."""

    __slots__ = ("addr",)

    def __init__(self, addr):
        self.addr = addr

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

    def try_acquire(self):
        return _sem_trywait(self.addr) == 0

    def acquire(self, spin_s, deadline, on_slice):
        """Take one unit; spin up to spin_s, then sleep in slices.

        on_slice() is called after every slice that ended without the unit; it
        raises to abort the wait (a dead peer, the deadline passed).
        """
        addr = self.addr
        if _sem_trywait(addr) == 0:
            return
        if spin_s > 0:
            end = time.perf_counter() + spin_s
            while time.perf_counter() < end:
                if _sem_trywait(addr) == 0:
                    return
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
