"""Latency-optimal algorithms for small messages: log2(P) steps instead of P-1.

all_reduce is recursive doubling (Thakur, Rabenseifner & Gropp, "Optimization
of collective communication operations in MPICH", IJHPCA 2005): in step k rank
r exchanges its whole buffer with rank r XOR 2^k and both combine, so after
log2(P) steps everyone holds the total.

    cost = log2(P) alpha + log2(P) n beta

Ring moves less data (2(P-1)/P n) but takes 2(P-1) steps; below a few tens of
KiB the alpha term dominates and the tree wins. When P is not a power of two
the extra ranks first fold their buffer into a partner and get the result
back at the end (two more steps). Because both partners combine the same two
operands, every rank ends with bit-identical results.

broadcast and reduce use a binomial tree rooted at the root: log2(P) steps.
"""
from .. import ops
from . import TAG, scratch


def all_reduce(transport, buf, code, op):
    P, me = transport.world_size, transport.rank
    if P == 1:
        return
    p2 = 1 << (P.bit_length() - 1)  # largest power of two <= P
    extra = P - p2
    tmp = scratch(buf)
    # Fold: ranks p2.. send to rank - p2, which absorbs them.
    if me >= p2:
        transport.send(buf, code, me - p2, TAG)
        transport.recv(buf, code, me - p2, TAG + 1)
        return
    if me < extra:
        transport.recv(tmp, code, me + p2, TAG)
        ops.combine(buf, buf, tmp, op, code)
    k = 1
    while k < p2:
        partner = me ^ k
        transport.sendrecv(buf, partner, tmp, partner, code, TAG + 2 + k)
        # Same operand order on both partners (lower rank first) keeps results identical.
        if me < partner:
            ops.combine(buf, buf, tmp, op, code)
        else:
            ops.combine(buf, tmp, buf, op, code)
        k <<= 1
    if op == "avg":
        ops.finish_avg(buf, P, code)
    if me < extra:
        transport.send(buf, code, me + p2, TAG + 1)


def broadcast(transport, buf, code, src):
    """Binomial tree: in round k, every rank that has the data sends it 2^k ranks further."""
    P = transport.world_size
    rel = (transport.rank - src) % P
    mask = 1
    while mask < P:
        if rel < mask:
            if rel + mask < P:
                transport.send(buf, code, (rel + mask + src) % P, TAG)
        elif rel < 2 * mask:
            transport.recv(buf, code, (rel - mask + src) % P, TAG)
        mask <<= 1


def reduce(transport, buf, code, op, dst):
    """Binomial tree towards dst; non-root buffers are left unchanged (the sum is built in a copy)."""
    P = transport.world_size
    rel = (transport.rank - dst) % P
    acc = buf if rel == 0 else buf.copy()
    tmp = scratch(buf)
    mask = 1
    while mask < P:
        if rel & mask:
            transport.send(acc, code, (rel - mask + dst) % P, TAG)
            return
        if rel + mask < P:
            transport.recv(tmp, code, (rel + mask + dst) % P, TAG)
            ops.combine(acc, acc, tmp, op, code)
        mask <<= 1
    if op == "avg":
        ops.finish_avg(acc, P, code)
