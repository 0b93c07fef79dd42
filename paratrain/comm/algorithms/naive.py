"""The master-based baseline: everything goes through one rank.

all_reduce gathers every buffer to rank 0, reduces there and sends the result
back: simple, and the scheme a first distributed trainer uses, but not
scalable: rank 0 receives and sends (P-1) full buffers one after another,

    cost = 2(P-1) alpha + 2(P-1) n beta   at the root,

so time grows linearly with P while ring's stays nearly flat. It is kept as
the reference the others are checked against, and as the portable fallback
for gather, scatter, all_gather and all_to_all on backends without native ones.
"""
from .. import ops
from . import TAG, scratch


def all_reduce(transport, buf, code, op):
    P, me = transport.world_size, transport.rank
    if P == 1:
        return
    if me == 0:
        tmp = scratch(buf)
        for q in range(1, P):
            transport.recv(tmp, code, q, TAG)
            ops.combine(buf, buf, tmp, op, code)
        if op == "avg":
            ops.finish_avg(buf, P, code)
        for q in range(1, P):
            transport.send(buf, code, q, TAG)
    else:
        transport.send(buf, code, 0, TAG)
        transport.recv(buf, code, 0, TAG)


def gather(transport, out, buf, code, dst):
    """out: list of P buffers on dst (None elsewhere). (P-1) alpha + (P-1) n beta at dst."""
    if transport.rank == dst:
        for q in range(transport.world_size):
            if q == dst:
                out[q][...] = buf
            else:
                transport.recv(out[q], code, q, TAG)
    else:
        transport.send(buf, code, dst, TAG)


def scatter(transport, buf, inp, code, src):
    if transport.rank == src:
        for q in range(transport.world_size):
            if q == src:
                buf[...] = inp[q]
            else:
                transport.send(inp[q], code, q, TAG)
    else:
        transport.recv(buf, code, src, TAG)


def all_gather(transport, out, buf, code):
    """Pairwise exchange: in step s, send to rank+s and receive from rank-s.
    (P-1) alpha + (P-1) n beta, with no root bottleneck."""
    P, me = transport.world_size, transport.rank
    out[me][...] = buf
    for s in range(1, P):
        dst, src = (me + s) % P, (me - s) % P
        transport.sendrecv(buf, dst, out[src], src, code, TAG)


def all_to_all(transport, out, inp, code):
    """Pairwise exchange of piece j with rank j; pieces may differ in size.

    In place (output pieces sharing memory with input pieces, as torch and MPI
    allow), the piece received at step s lands where an input sent only at step
    P - s still lies, so the input is copied aside first: + n beta."""
    P, me = transport.world_size, transport.rank
    if any(ops.overlaps(o, inp) for o in out):
        inp = [p.copy() for p in inp]
    out[me][...] = inp[me]
    for s in range(1, P):
        dst, src = (me + s) % P, (me - s) % P
        transport.sendrecv(inp[dst], dst, out[src], src, code, TAG)


def reduce_scatter(transport, out, inp, code, op):
    """Each rank receives piece r from every other rank and reduces it: (P-1)(alpha + n beta)."""
    P, me = transport.world_size, transport.rank
    out[...] = inp[me]
    tmp = scratch(out)
    for s in range(1, P):
        dst, src = (me + s) % P, (me - s) % P
        transport.sendrecv(inp[dst], dst, tmp, src, code, TAG)
        ops.combine(out, out, tmp, op, code)
    if op == "avg":
        ops.finish_avg(out, P, code)
