"""Direct algorithms: what shared memory allows beyond message passing.

With message passing a rank only sees what is sent to it, so all-reduce needs
a ring or a tree. In shared memory every rank can read every other rank's
buffer, so each collective is a few rounds of "write into my slot, barrier,
read what I need from anyone's slot" (ShmGroup explains the double-buffered
slots that make one barrier per round enough).

all_reduce, the one that matters most, is a reduce-scatter and an all-gather
in one pass over shared memory, with no intermediate hops:

1. rank r copies the parts of its buffer that *other* ranks will reduce into
   its slot (its own part stays in private memory: (P-1)/P n bytes copied in);
2. barrier; rank r reduces part r reading all P inputs where they lie, in
   rank order 0..P-1 (so the result is bit-identical to the naive algorithm),
   and writes the result into its slot and its own buffer;
3. barrier; rank r copies the other P-1 reduced parts out of their owners' slots.

Each rank copies (P-1)/P n in, reads n and writes 2n/P to reduce, copies
(P-1)/P n out, and waits on 2 barriers per round: the bytes of a ring
all-reduce with 2 latency steps instead of 2(P-1). A large message goes in
rounds of slot_bytes so each round stays in cache and rounds pipeline through
the two buffers.

    cost per round of m bytes = 2 alpha_barrier + (3 (P-1)/P + 2/P) m beta_memcpy
"""
from .. import ops
from . import split_bounds


def _rounds(n, per_round):
    """(lo, hi) element ranges of each round; at least one round so that even a
    zero-length call meets the others at a barrier (and the mismatch check)."""
    per_round = max(1, per_round)
    return [(lo, min(n, lo + per_round)) for lo in range(0, n, per_round)] or [(0, 0)]


def all_reduce(G, buf, code, op, dst=None):
    """dst=None: every rank gets the result (all_reduce); dst=r: only rank r (reduce)."""
    P, me, dt = G.world_size, G.rank, buf.dtype
    for lo, hi in _rounds(buf.size, G.slot_bytes // buf.itemsize):
        slots = [s.view(dt) for s in G._next_slots()]
        b = split_bounds(hi - lo, P)
        x = buf[lo:hi]
        mine = slots[me]
        for q in range(P):
            if q != me:
                mine[b[q]:b[q + 1]] = x[b[q]:b[q + 1]]
        G._sync()
        s0, s1 = b[me], b[me + 1]
        acc = mine[s0:s1]
        parts = [x[s0:s1] if q == me else slots[q][s0:s1] for q in range(P)]
        if P == 1:
            acc[...] = parts[0]
        else:
            ops.combine(acc, parts[0], parts[1], op, code)
            for q in range(2, P):
                ops.combine(acc, acc, parts[q], op, code)
        if op == "avg":
            ops.finish_avg(acc, P, code)
        if dst is None or dst == me:
            x[s0:s1] = acc
        G._sync()
        if dst is None or dst == me:
            for q in range(P):
                if q != me:
                    x[b[q]:b[q + 1]] = slots[q][b[q]:b[q + 1]]


def broadcast(G, buf, code, src):
    """Root writes a round, barrier, everyone else copies it: alpha + 2 m beta per round."""
    me = G.rank
    for lo, hi in _rounds(buf.size, G.slot_bytes // buf.itemsize):
        slot = G._next_slots()[src].view(buf.dtype)
        if me == src:
            slot[:hi - lo] = buf[lo:hi]
        G._sync()
        if me != src:
            buf[lo:hi] = slot[:hi - lo]


def all_gather(G, out, buf, code):
    P, me = G.world_size, G.rank
    out[me][...] = buf
    for lo, hi in _rounds(buf.size, G.slot_bytes // buf.itemsize):
        slots = [s.view(buf.dtype) for s in G._next_slots()]
        slots[me][:hi - lo] = buf[lo:hi]
        G._sync()
        for q in range(P):
            if q != me:
                out[q][lo:hi] = slots[q][:hi - lo]


def gather(G, out, buf, code, dst):
    P, me = G.world_size, G.rank
    if me == dst:
        out[me][...] = buf
    for lo, hi in _rounds(buf.size, G.slot_bytes // buf.itemsize):
        slots = [s.view(buf.dtype) for s in G._next_slots()]
        if me != dst:
            slots[me][:hi - lo] = buf[lo:hi]
        G._sync()
        if me == dst:
            for q in range(P):
                if q != me:
                    out[q][lo:hi] = slots[q][:hi - lo]


def scatter(G, buf, inp, code, src):
    """The root's slot holds one sub-slot per destination each round."""
    P, me = G.world_size, G.rank
    if me == src:
        buf[...] = inp[me]
    per = G.slot_bytes // buf.itemsize // P
    for lo, hi in _rounds(buf.size, per):
        slot = G._next_slots()[src].view(buf.dtype)
        if me == src:
            for q in range(P):
                if q != me:
                    slot[q * per:q * per + hi - lo] = inp[q][lo:hi]
        G._sync()
        if me != src:
            buf[lo:hi] = slot[me * per:me * per + hi - lo]


def all_to_all(G, out, inp, code):
    """Equal pieces: rank r's slot holds its piece for every q; q reads sub-slot q of everyone's slot."""
    P, me = G.world_size, G.rank
    out[me][...] = inp[me]
    n = inp[0].size
    per = G.slot_bytes // inp[0].itemsize // P
    for lo, hi in _rounds(n, per):
        slots = [s.view(inp[0].dtype) for s in G._next_slots()]
        for q in range(P):
            if q != me:
                slots[me][q * per:q * per + hi - lo] = inp[q][lo:hi]
        G._sync()
        for q in range(P):
            if q != me:
                out[q][lo:hi] = slots[q][me * per:me * per + hi - lo]


def reduce_scatter(G, out, inp, code, op):
    """Each rank writes the pieces others own, then reduces its own piece reading
    all slots in rank order: (P-1)/P of the input copied in, one barrier per round."""
    P, me, dt = G.world_size, G.rank, out.dtype
    per = G.slot_bytes // out.itemsize // P
    for lo, hi in _rounds(out.size, per):
        slots = [s.view(dt) for s in G._next_slots()]
        m = hi - lo
        for q in range(P):
            if q != me:
                slots[me][q * per:q * per + m] = inp[q][lo:hi]
        G._sync()
        parts = [inp[me][lo:hi] if q == me else slots[q][me * per:me * per + m] for q in range(P)]
        acc = out[lo:hi]
        if P == 1:
            acc[...] = parts[0]
        else:
            ops.combine(acc, parts[0], parts[1], op, code)
            for q in range(2, P):
                ops.combine(acc, acc, parts[q], op, code)
        if op == "avg":
            ops.finish_avg(acc, P, code)
