"""Collectives on buffers that already live in shared memory: no copy in, no copy out.

When every rank's tensor lies in a shared allocation (``g.empty_shared``, see
shared.py), a rank can read its peers' tensors where they are (``G`` is the
group's Rounds, rounds.py; ``region`` the SharedRegion the tensor lies in). The
all-reduce is then a reduce-scatter and an all-gather done directly on the
tensors themselves, in rounds of ``round_bytes`` so each round stays in cache:

1. reduce: rank r reduces slice r of the round, reading that slice of all P
   tensors, and writes the result over slice r of its *own* tensor (nobody
   else reads that slice of rank r's tensor: they each read their own slice);
2. gather: after a barrier, rank r copies every other slice q of the round from
   rank q's tensor, where q left the finished result.

Reduce of round k and gather of round k-1 touch different memory, so they share
one barrier: between barriers a rank reduces round k and gathers round k-1.
One barrier first (every rank's input is complete, and the call descriptors
agree), one per round, and one last (nobody still reads a tensor its owner is
about to overwrite, e.g. with the next step's gradients).

Per rank, for a message of n bytes: n read and n/P written to reduce,
(P-1)/P n copied to gather. Against the direct algorithm over private memory
this saves the (P-1)/P n copy-in and the n/P copy back of the rank's own part:

    cost = (R + 2) alpha_barrier + (n + (P-1)/P n + n/P) beta_mem

The reduction order is the owner's own slice first, then the others in rank
order: each slice is computed once and copied, so every rank ends with the
same bits (for P = 2 they also equal the naive algorithm's: a + b == b + a).

all_gather and reduce_scatter on a resident input follow at the end: each is
one pass over the peers' inputs between two barriers.
"""
from .. import ops
from ..algorithms import scratch, split_bounds
from .direct import reduce_parts

ROUND_BYTES = 1 << 20


def all_reduce(G, region, offset, buf, code, op, round_bytes=ROUND_BYTES):
    P, me, dt = G.world_size, G.rank, buf.dtype
    views = region.views(offset, buf.size, dt)
    per = max(1, round_bytes // buf.itemsize)
    rounds = [(lo, min(buf.size, lo + per)) for lo in range(0, buf.size, per)]
    bounds = [split_bounds(hi - lo, P) for lo, hi in rounds]
    G.sync()  # everyone's input is in place
    for k in range(len(rounds) + 1):
        if k < len(rounds):
            _reduce_slice(views, rounds[k][0], bounds[k], me, P, op, code)
        if k >= 1:
            _gather_round(views, rounds[k - 1][0], bounds[k - 1], me, P)
        G.sync()


def _reduce_slice(views, lo, b, me, P, op, code):
    s0, s1 = lo + b[me], lo + b[me + 1]
    acc = views[me][s0:s1]
    for q in range(P):
        if q != me:
            ops.combine(acc, acc, views[q][s0:s1], op, code)
    if op == "avg":
        ops.finish_avg(acc, P, code)


def _gather_round(views, lo, b, me, P):
    for q in range(P):
        if q != me:
            s0, s1 = lo + b[q], lo + b[q + 1]
            ops.copy(views[me][s0:s1], views[q][s0:s1])


def all_gather(G, region, offset, out, buf):
    """Every rank copies each peer's input straight from where it lies: one barrier
    so the inputs are complete, P copies of n/P... of m bytes each, one barrier so
    nobody overwrites its input while a peer still reads it.

        cost = 2 alpha_barrier + P m beta_mem      (m = bytes per rank's input)

    Over private memory (direct.all_gather) each peer's piece is copied twice, into
    its owner's slot and out of it; here once, as a single-copy (CMA / XPMEM)
    transport in MPI would do, but without a system call per message."""
    P, me = G.world_size, G.rank
    views = region.views(offset, buf.size, buf.dtype)
    G.sync()
    for q in range(P):
        if q == me:
            if ops.address(out[me]) != ops.address(buf):
                ops.copy(out[me], buf)
        else:
            ops.copy(out[q], views[q])
    G.sync()


def reduce_scatter(G, region, offset, out, inp, code, op):
    """Rank r reduces piece r of every rank's input, read where it lies, in rank order.
    One barrier before (inputs complete) and one after (inputs still being read).

        cost = 2 alpha_barrier + (P m + m) beta_mem      (m = bytes of the output)

    If ``out`` overlaps this rank's own input (an in-place call), the reduction
    goes through a scratch buffer, so no input is overwritten before it is read."""
    P, me, n = G.world_size, G.rank, out.size
    views = region.views(offset, n * P, out.dtype)
    parts = [views[q][me * n:(me + 1) * n] for q in range(P)]
    G.sync()
    if ops.overlaps(out, inp):
        tmp = scratch(out)
        reduce_parts(tmp, parts, op, code, P)
        G.sync()
        ops.copy(out, tmp)
        return
    reduce_parts(out, parts, op, code, P)
    G.sync()

