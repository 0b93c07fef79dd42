"""Single-copy collectives over private memory: cross-memory attach (CMA).

Over private buffers the direct algorithms (direct.py) copy each byte twice:
into the owner's shared slot, then out of it into the reader's buffer. Linux
can do it in one: ``process_vm_readv(pid, local, remote)`` copies from another
process's address space into ours, in the kernel, with no intermediate
buffer. Open MPI's shared-memory transport uses it for large messages (its
"single-copy" mechanism, ``smsc/cma``; XPMEM and KNEM are the alternatives),
and that is where its all_gather beat our two-copy one. Here it is a system
call through ctypes to libc, not a compiled extension.

all_gather over CMA:

1. every rank publishes the address and length of its input in its slot;
2. barrier (also the always-on mismatch check);
3. rank r copies its own input into out[r] and reads every peer's input
   straight into out[q] with process_vm_readv;
4. barrier: nobody returns, and overwrites or frees its input, while a peer
   still reads it.

    cost = 2 alpha_barrier + P alpha_syscall + P m beta_mem    (m = bytes per input)

against 2 alpha_barrier per slot round + (P + 1) m beta_mem for direct.all_gather.

CMA needs the kernel's permission to read a peer (the ptrace access check:
same user, and Yama's ptrace_scope 0, or a seccomp profile that allows the
call). Whether it works is found out once per group, with every rank reading
every peer's probe value and all ranks agreeing on the result, so a machine
that forbids it silently uses the two-copy algorithm. ``PARATRAIN_CMA=0``
turns it off.
"""
import ctypes
import errno
import os

import numpy as np

from .. import ops
from ..errors import PeerError

MIN_BYTES = 256 * 1024    # per input; below it the slot copies cost less than the system calls
_PROBE = 0x636D615F70726F62  # "cma_prob"


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc_call():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_readv = _libc_call()


def address(a):
    return a.__array_interface__["data"][0]


def read(pid, dst, remote_address, rank=None):
    """Copy dst.nbytes bytes from ``remote_address`` in process ``pid`` into the
    contiguous array ``dst``. The kernel may copy less than asked (a partial read
    at a page it could not fault in), so it loops; an error names the peer."""
    nbytes, done, base = dst.nbytes, 0, address(dst)
    while done < nbytes:
        local = _IOVec(base + done, nbytes - done)
        remote = _IOVec(remote_address + done, nbytes - done)
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            if err == errno.ESRCH:
                raise PeerError(f"rank {rank} (pid {pid}) exited while this rank read its buffer", [rank])
            raise OSError(err, f"process_vm_readv from rank {rank} (pid {pid}): {os.strerror(err)}")
        done += got


def usable(G):
    """Can every rank of G read every peer's memory? Decided once per group, with one
    probe round that every rank takes part in, so all agree (a rank that cannot read
    would otherwise be left with half an output). Called by every rank at the same
    point of the same collective, as the collectives themselves are."""
    ok = getattr(G, "_cma_ok", None)
    if ok is not None:
        return ok
    P, me = G.world_size, G.rank
    willing = _readv is not None and os.environ.get("PARATRAIN_CMA", "1") != "0"
    probe = np.array([_PROBE], dtype=np.int64)
    slots = [s.view(np.int64) for s in G._next_slots()]
    slots[me][0] = address(probe) if willing else 0
    G._sync()
    mine = willing
    got = np.zeros(1, dtype=np.int64)
    for q in range(P):
        if q != me and mine:
            try:
                read(int(G._pids[q]), got, int(slots[q][0]), G.ranks[q])
                mine = int(slots[q][0]) != 0 and got[0] == _PROBE
            except OSError:
                mine = False
    flags = [s.view(np.int64) for s in G._next_slots()]
    flags[me][0] = int(bool(mine))
    G._sync()   # the probe reads are over (probe may go), and every flag is written
    G._cma_ok = all(int(flags[q][0]) == 1 for q in range(P))
    return G._cma_ok


def all_gather(G, out, buf):
    """out[q] <- rank q's buf for every q, each peer's input read once, in place."""
    P, me = G.world_size, G.rank
    slot = G._next_slots()
    views = [s.view(np.int64) for s in slot]
    views[me][0] = address(buf)
    views[me][1] = buf.nbytes
    G._sync()
    if address(out[me]) != address(buf):
        ops.copy(out[me], buf)
    for q in range(P):
        if q != me:
            if int(views[q][1]) != out[q].nbytes:   # the descriptor check makes this unreachable
                raise ValueError(f"rank {G.ranks[q]} gathers {int(views[q][1])} bytes, this rank "
                                 f"expects {out[q].nbytes}")
            read(int(G._pids[q]), out[q], int(views[q][0]), G.ranks[q])
    G._sync()
