"""Direct algorithms: what shared memory allows beyond message passing.

With message passing a rank only sees what is sent to it, so all-reduce needs
a ring or a tree. In shared memory every rank can read every other rank's
buffer, so each collective is a few rounds of "write into my slot, barrier,
read what I need from anyone's slot" (ShmGroup explains the double-buffered
slots that make one barrier per round enough). Each function takes ``G``, the
group's Rounds (rounds.py), and uses only what it documents.

all_reduce, the one that matters most, is a reduce-scatter and an all-gather
in one pass over shared memory, with no intermediate hops. For each round of
the message (slot_bytes at a time, so a round stays in cache):

1. copy-in: rank r copies the parts of its buffer that *other* ranks will
   reduce into its slot (its own part stays in private memory);
2. reduce: rank r reduces part r reading all P inputs where they lie, in rank
   order 0..P-1 (so the result is bit-identical to the naive algorithm), into
   its slot, and copies it into its own buffer;
3. copy-out: rank r copies the other P-1 reduced parts out of their owners' slots.

Each step needs the previous one finished on every rank, but steps of
different rounds do not depend on each other, so they are pipelined: between
barrier k-1 and barrier k a rank reduces round k-1, copies out round k-2 and
copies in round k. With three buffers per rank, that is one barrier per round
(R+1 for R rounds, instead of 2R).

Per rank and round of m bytes: (P-1)/P m copied in, m read and 2m/P written to
reduce, (P-1)/P m copied out: the bytes a ring moves, with 1 latency step per
round instead of 2(P-1) per message.

    cost = (R + 1) alpha_barrier + (3 (P-1)/P + 2/P) n beta_memcpy

Small messages take a shortcut: every rank copies its whole buffer in, one
barrier, and every rank reduces the whole message itself. P times the
reduction work, but one barrier instead of two and no copy-out. With 2 ranks
it wins up to about 512 KiB (SMALL_BYTES); the extra work grows with P, so
the limit is SMALL_BYTES / (P-1).
"""
from .. import ops
from ..algorithms import scratch, split_bounds

SMALL_BYTES = 512 * 1024


def rounds_of(n, per_round):
    """(lo, hi) element ranges of each round; at least one round so that even a
    zero-length call meets the others at a barrier (and the mismatch check)."""
    per_round = max(1, per_round)
    return [(lo, min(n, lo + per_round)) for lo in range(0, n, per_round)] or [(0, 0)]


def reduce_parts(acc, parts, op, code, P):
    """acc = parts[0] op parts[1] op ... in rank order. acc may alias parts[0] or
    parts[1] (read by the first combine), not a later part, which the first combine
    would overwrite before it is read: reduce_scatter in place goes through a scratch."""
    if P == 1:
        ops.copy(acc, parts[0])
    else:
        ops.combine(acc, parts[0], parts[1], op, code)
        for q in range(2, P):
            ops.combine(acc, acc, parts[q], op, code)
    if op == "avg":
        ops.finish_avg(acc, P, code)


def takes_small_path(G, buf):
    return buf.nbytes <= G.slot_bytes and buf.nbytes * (G.world_size - 1) <= SMALL_BYTES


def all_reduce(G, buf, code, op, dst=None):
    """dst=None: every rank gets the result (all_reduce); dst=r: only rank r (reduce)."""
    if takes_small_path(G, buf):
        return _all_reduce_small(G, buf, code, op, dst)
    P, me = G.world_size, G.rank
    keep = dst is None or dst == me
    rounds = rounds_of(buf.size, G.slot_bytes // buf.itemsize)
    R = len(rounds)
    state = []  # per round: (x, slots, bounds)
    for k in range(R + 1):
        if k >= 1:  # reduce round k-1: everyone's copy-in of it finished before barrier k-1
            x, slots, b = state[k - 1]
            s0, s1 = b[me], b[me + 1]
            acc = slots[me][s0:s1]  # no input lives here: copy-in skipped our own part
            reduce_parts(acc, [x[s0:s1] if q == me else slots[q][s0:s1] for q in range(P)], op, code, P)
            if keep:
                ops.copy(x[s0:s1], acc)
        if k >= 2 and keep:  # copy out round k-2: reduced before barrier k-1
            _copy_out(state[k - 2], me, P)
        if k < R:
            state.append(copy_in(G, buf, *rounds[k]))
        G.sync()
        if k >= 2:
            state[k - 2] = None
    if keep:
        _copy_out(state[R - 1], me, P)


def copy_in(G, buf, lo, hi):
    """Round [lo, hi) of buf: copy the slices the other ranks reduce into this rank's
    slot (its own slice stays in private memory). Returns the round's state:
    (the round's part of buf, every rank's slot for it, the slices' bounds)."""
    P, me = G.world_size, G.rank
    x = buf[lo:hi]
    slots = [sl.view(buf.dtype) for sl in G.next_slots()]
    b = split_bounds(hi - lo, P)
    for q in range(P):
        if q != me:
            ops.copy(slots[me][b[q]:b[q + 1]], x[b[q]:b[q + 1]])
    return x, slots, b


def _copy_out(round_state, me, P):
    x, slots, b = round_state
    for q in range(P):
        if q != me:
            ops.copy(x[b[q]:b[q + 1]], slots[q][b[q]:b[q + 1]])


def _all_reduce_small(G, buf, code, op, dst):
    """The whole buffer copied in, one barrier, every rank reduces all P inputs:
    alpha_barrier + n beta_memcpy + P n beta_reduce."""
    P, me = G.world_size, G.rank
    slots = [sl.view(buf.dtype)[:buf.size] for sl in G.next_slots()]
    ops.copy(slots[me], buf)
    G.sync()
    if dst is None or dst == me:
        reduce_parts(buf, slots, op, code, P)


def broadcast(G, buf, code, src):
    """Root writes a round, barrier, everyone else copies it: alpha + 2 m beta per round."""
    me = G.rank
    for lo, hi in rounds_of(buf.size, G.slot_bytes // buf.itemsize):
        slot = G.next_slots()[src].view(buf.dtype)
        if me == src:
            ops.copy(slot[:hi - lo], buf[lo:hi])
        G.sync()
        if me != src:
            ops.copy(buf[lo:hi], slot[:hi - lo])


def all_gather(G, out, buf, code):
    """Each round every rank writes its piece into its slot, barrier, and copies the
    P-1 others out; with m the bytes of one rank's input and R = m / slot_bytes rounds:
    R alpha_barrier + (P + 1) m beta (own piece, copy-in, P-1 copies out)."""
    P, me = G.world_size, G.rank
    ops.copy(out[me], buf)
    for lo, hi in rounds_of(buf.size, G.slot_bytes // buf.itemsize):
        slots = [s.view(buf.dtype) for s in G.next_slots()]
        ops.copy(slots[me][:hi - lo], buf[lo:hi])
        G.sync()
        for q in range(P):
            if q != me:
                ops.copy(out[q][lo:hi], slots[q][:hi - lo])


def gather(G, out, buf, code, dst):
    """all_gather with only the root copying out: R alpha_barrier + P m beta at the
    root, m beta elsewhere (m the bytes of one rank's input)."""
    P, me = G.world_size, G.rank
    if me == dst:
        ops.copy(out[me], buf)
    for lo, hi in rounds_of(buf.size, G.slot_bytes // buf.itemsize):
        slots = [s.view(buf.dtype) for s in G.next_slots()]
        if me != dst:
            ops.copy(slots[me][:hi - lo], buf[lo:hi])
        G.sync()
        if me == dst:
            for q in range(P):
                if q != me:
                    ops.copy(out[q][lo:hi], slots[q][:hi - lo])


def scatter(G, buf, inp, code, src):
    """The root's slot holds one sub-slot per destination each round, so a round
    carries slot_bytes / P of each piece: with m the bytes of one piece and
    R = P m / slot_bytes rounds, R alpha_barrier + P m beta at the root and
    m beta elsewhere."""
    P, me = G.world_size, G.rank
    if me == src:
        ops.copy(buf, inp[me])
    per = G.slot_bytes // buf.itemsize // P
    for lo, hi in rounds_of(buf.size, per):
        slot = G.next_slots()[src].view(buf.dtype)
        if me == src:
            for q in range(P):
                if q != me:
                    ops.copy(slot[q * per:q * per + hi - lo], inp[q][lo:hi])
        G.sync()
        if me != src:
            ops.copy(buf[lo:hi], slot[me * per:me * per + hi - lo])


def all_to_all(G, out, inp, code):
    """Equal pieces: rank r's slot holds its piece for every q; q reads sub-slot q of
    everyone's slot. With m the bytes of one piece and R = P m / slot_bytes rounds:
    R alpha_barrier + (2 (P-1) + 1) m beta per rank (P-1 pieces in, P-1 out, its own)."""
    P, me = G.world_size, G.rank
    ops.copy(out[me], inp[me])
    n = inp[0].size
    per = G.slot_bytes // inp[0].itemsize // P
    for lo, hi in rounds_of(n, per):
        slots = [s.view(inp[0].dtype) for s in G.next_slots()]
        for q in range(P):
            if q != me:
                ops.copy(slots[me][q * per:q * per + hi - lo], inp[q][lo:hi])
        G.sync()
        for q in range(P):
            if q != me:
                ops.copy(out[q][lo:hi], slots[q][me * per:me * per + hi - lo])


def reduce_scatter(G, out, inp, code, op):
    """Each rank writes the pieces others own, then reduces its own piece reading
    all slots in rank order: (P-1)/P of the input copied in, one barrier per round.
    With m the bytes of one output piece and R = P m / slot_bytes rounds:
    R alpha_barrier + (P-1) m beta_memcpy + P m beta_reduce.

    In place (``out`` a view of this rank's own input piece, as ZeRO and FSDP
    call it), the rank-order reduction would overwrite piece ``me`` before it
    reads it whenever me >= 2; it goes through a scratch output instead, copied
    over ``out`` once every round has read the input: + m beta_memcpy."""
    if ops.overlaps(out, inp):
        tmp = scratch(out)
        _reduce_scatter(G, tmp, inp, code, op)
        ops.copy(out, tmp)
    else:
        _reduce_scatter(G, out, inp, code, op)


def _reduce_scatter(G, out, inp, code, op):
    P, me, dt = G.world_size, G.rank, out.dtype
    per = G.slot_bytes // out.itemsize // P
    for lo, hi in rounds_of(out.size, per):
        slots = [s.view(dt) for s in G.next_slots()]
        m = hi - lo
        for q in range(P):
            if q != me:
                ops.copy(slots[me][q * per:q * per + m], inp[q][lo:hi])
        G.sync()
        parts = [inp[me][lo:hi] if q == me else slots[q][me * per:me * per + m] for q in range(P)]
        reduce_parts(out[lo:hi], parts, op, code, P)
