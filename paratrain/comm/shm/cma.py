"""Single-copy collectives over private memory: cross-memory attach (CMA).

Over private buffers the direct algorithms (direct.py) copy each byte twice:
into the owner's shared slot, then out of it into the reader's buffer. Linux
can do it in one: ``process_vm_readv(pid, local, remote)`` copies from another
process's address space into ours, in the kernel, with no intermediate
buffer. Open MPI's shared-memory transport uses it for large messages (its
"single-copy" mechanism, ``smsc/cma``; XPMEM and KNEM are the alternatives),
which is what makes its all_gather of large inputs faster than a two-copy
one. Here it is a system call through ctypes to libc, not a compiled
extension. ``G`` is the group's Rounds (rounds.py).

all_gather over CMA:

1. every rank publishes the address and length of its input in its slot;
2. barrier (also the always-on mismatch check);
3. rank r reads every peer's input straight into out[q] with
   process_vm_readv, and copies its own into out[r], all in rank order;
4. barrier: nobody returns, and overwrites or frees its input, while a peer
   still reads it.

    cost = 2 alpha_barrier + P alpha_syscall + P m beta_mem    (m = bytes per input)

against 2 alpha_barrier per slot round + (P + 1) m beta_mem for direct.all_gather.
Open MPI moves the same bytes with the same calls (one process_vm_readv per
peer, one copy), so what separates the two is the fixed cost: the Python
before the first byte moves, which runs with the caches just flushed by the
previous call's copies, so that path is kept short (ops.as_buffer, ops.address).

CMA needs the kernel's permission to read a peer (the ptrace access check:
same user, and Yama's ptrace_scope 0, or a seccomp profile that allows the
call). Whether it works is found out once per group, with every rank reading
every peer's probe value and all ranks agreeing on the result, so a machine
that forbids it silently uses the two-copy algorithm. ``PARATRAIN_CMA=0``
turns it off.

all_reduce of large private buffers (from MIN_ALL_REDUCE_BYTES) uses the
same call for its copy-out: see all_reduce below.
"""
import ctypes
import errno
import os

import numpy as np

from ... import config
from .. import ops
from ..errors import PeerError
from ..algorithms import scratch
from .direct import copy_in, reduce_parts, rounds_of

# Per input; below it the two-copy path through the slots (direct.all_gather) is
# faster: its 1 MiB rounds copy within the cache, where process_vm_readv pins each
# page of the peer's buffer and copies slower than memcpy.
MIN_BYTES = 4 << 20
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


def read(pid, dst, remote_address, rank=None):
    """Copy dst.nbytes bytes from ``remote_address`` in process ``pid`` into the
    contiguous array ``dst``. The kernel may copy less than asked (a partial read
    at a page it could not fault in), so it loops; an error names the peer."""
    nbytes, done, base = dst.nbytes, 0, ops.address(dst)
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
    """Can every rank of G read every peer's memory? One probe round that every rank
    takes part in, so all agree (a rank that cannot read would otherwise be left
    with half an output). Called by every rank at the same point of the same
    collective, as the collectives themselves are; the group keeps the answer."""
    P, me = G.world_size, G.rank
    willing = _readv is not None and config.get("PARATRAIN_CMA")
    probe = np.array([_PROBE], dtype=np.int64)
    slots = G.next_words()
    slots[me][0] = ops.address(probe) if willing else 0
    G.sync()
    mine = willing
    got = np.zeros(1, dtype=np.int64)
    for q in range(P):
        if q != me and mine:
            try:
                read(int(G.pids[q]), got, int(slots[q][0]), G.ranks[q])
                mine = int(slots[q][0]) != 0 and got[0] == _PROBE
            except OSError:
                mine = False
    flags = G.next_words()
    flags[me][0] = int(bool(mine))
    G.sync()   # the probe reads are over (probe may go), and every flag is written
    return all(int(flags[q][0]) == 1 for q in range(P))


def all_gather(G, out, buf):
    """out[q] <- rank q's buf for every q, each peer's input read once, in place.

    Every rank walks the inputs in rank order, its own included (a copy instead
    of a read), so at step q all ranks are copying input q at once: its owner's
    copy and the readers' share the lines one of them brought into the shared
    L3, and input q comes from memory about once instead of once per rank (own
    input first, then the peers, Open MPI's order, is slower)."""
    P, me = G.world_size, G.rank
    views, mine = G.next_words(), ops.address(buf)
    views[me][0] = mine
    views[me][1] = buf.nbytes
    G.sync()
    for q in range(P):
        if q == me:
            if ops.address(out[me]) != mine:
                ops.copy_vectorised(out[me], buf)
            continue
        if int(views[q][1]) != out[q].nbytes:   # the descriptor check makes this unreachable
            raise ValueError(f"rank {G.ranks[q]} gathers {int(views[q][1])} bytes, this rank "
                             f"expects {out[q].nbytes}")
        read(int(G.pids[q]), out[q], int(views[q][0]), G.ranks[q])
    G.sync()


MIN_ALL_REDUCE_BYTES = 32 << 20   # below, the buffers stay in the L3 (32 MiB here) and the two-copy path wins


def all_reduce(G, buf, code, op):
    """All-reduce of a large private buffer: direct.all_reduce's rounds, but each
    rank reduces its slice straight into its own buffer and the peers fetch it
    from there with process_vm_readv, instead of through the owner's slot.

    Between barrier k-1 and barrier k a rank copies round k's other slices into
    its slot (as direct.py), reduces round k-1's own slice reading the peers'
    slots, in rank order, into its buffer (through a scratch when P > 2, so the
    input it still needs is not overwritten), and reads round k-2's other slices
    from their owners' buffers. Nobody writes what another reads in the same
    interval: a slice is reduced one interval after its copy-in and fetched one
    interval after it is reduced. One barrier per round, plus one first (the
    addresses) and one last (nobody returns while a peer still reads its buffer).

        cost = (R + 2) alpha_barrier + (P-1) R alpha_syscall
               + ((P-1)/P n + n + n/P + (P-1)/P n) beta_mem

    Against direct.all_reduce it skips copying the reduced slice back out of the
    slot, and the copy-out is the kernel's (a ``rep movsb``, fast for large
    copies, benchmarks/memcpy.py) out of DRAM. That wins once the buffers no
    longer fit in the L3; below, the rounds stay in cache and the system calls
    cost more than the copy they save: hence MIN_ALL_REDUCE_BYTES.
    """
    P, me = G.world_size, G.rank
    addresses = G.next_words()
    addresses[me][0] = ops.address(buf)
    rounds = rounds_of(buf.size, G.slot_bytes // buf.itemsize)
    R = len(rounds)
    acc = None if P == 2 else scratch(buf, G.slot_bytes // buf.itemsize)
    state, peers = [], None   # per round: (x, slots, bounds); peers: (q, pid, address of q's buf, rank)
    for k in range(R + 2):
        if k == 1:
            peers = [(q, int(G.pids[q]), int(addresses[q][0]), G.ranks[q]) for q in range(P) if q != me]
        if 1 <= k <= R:
            _reduce_own_slice(state[k - 1], me, P, op, code, acc)
        if k >= 2:
            x, _, b = state[k - 2]
            lo = rounds[k - 2][0]
            for q, pid, base, rank in peers:
                read(pid, x[b[q]:b[q + 1]], base + (lo + b[q]) * buf.itemsize, rank)
            state[k - 2] = None
        if k < R:
            state.append(copy_in(G, buf, *rounds[k]))
        G.sync()


def _reduce_own_slice(round_state, me, P, op, code, acc):
    x, slots, b = round_state
    s0, s1 = b[me], b[me + 1]
    parts = [x[s0:s1] if q == me else slots[q][s0:s1] for q in range(P)]
    if acc is None:   # P = 2: a + b elementwise, safe in place
        reduce_parts(x[s0:s1], parts, op, code, P)
    else:
        reduce_parts(acc[:s1 - s0], parts, op, code, P)
        ops.copy(x[s0:s1], acc[:s1 - s0])
