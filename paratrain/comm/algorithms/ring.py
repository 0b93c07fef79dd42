"""Ring all-reduce: scatter-reduce for P-1 steps, then all-gather for P-1 steps.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations" (JPDC 2009); the scheme Baidu brought to deep learning and
Horovod adopted (Sergeev & Del Balso, arXiv 1802.05799).

The buffer is cut into P segments. In step s of the scatter-reduce, rank r
sends segment (r - s) to its right neighbour and receives segment (r - s - 1)
from its left one, adding it into its own copy; after P-1 steps rank r holds
the full reduction of segment (r + 1). The all-gather then passes the reduced
segments around the ring for P-1 more steps.

    cost = 2(P-1) alpha + 2 (P-1)/P n beta

Every rank sends 2(P-1)/P of the buffer, independent of P: bandwidth-optimal.
Each segment is further cut into pipeline chunks sent as separate messages,
so a rank reduces chunk k while chunk k+1 is still arriving: a large message
streams instead of waiting for the whole segment.
"""
from .. import ops
from . import TAG, scratch, split_bounds

PIPELINE_BYTES = 1 << 20


def _chunks(lo, hi, step):
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)] or [(lo, hi)]


def all_reduce(transport, buf, code, op):
    P, me = transport.world_size, transport.rank
    if P == 1:
        return
    right, left = (me + 1) % P, (me - 1) % P
    seg = split_bounds(buf.size, P)
    step = max(1, PIPELINE_BYTES // buf.itemsize)
    tmp = scratch(buf, seg[1] - seg[0] + 1)

    # Scatter-reduce: P-1 steps; afterwards segment (me + 1) % P is fully reduced here.
    for s in range(P - 1):
        send_i, recv_i = (me - s) % P, (me - s - 1) % P
        if max(seg[send_i + 1] - seg[send_i], seg[recv_i + 1] - seg[recv_i]) <= step:
            # One chunk each way: a plain exchange, no helper thread to wake per step.
            a, b = seg[recv_i], seg[recv_i + 1]
            transport.sendrecv(buf[seg[send_i]:seg[send_i + 1]], right, tmp[:b - a], left, code, TAG + s)
            ops.combine(buf[a:b], buf[a:b], tmp[:b - a], op, code)
            continue
        sends = [transport.isend(buf[a:b], code, right, TAG + s)
                 for a, b in _chunks(seg[send_i], seg[send_i + 1], step)]
        for a, b in _chunks(seg[recv_i], seg[recv_i + 1], step):
            t = tmp[:b - a]
            transport.recv(t, code, left, TAG + s)
            ops.combine(buf[a:b], buf[a:b], t, op, code)  # overlaps the next chunk's arrival
        for work in sends:
            work.wait()

    own = (me + 1) % P
    if op == "avg":
        ops.finish_avg(buf[seg[own]:seg[own + 1]], P, code)

    # All-gather: P-1 steps passing the reduced segments around.
    for s in range(P - 1):
        send_i, recv_i = (me + 1 - s) % P, (me - s) % P
        transport.sendrecv(buf[seg[send_i]:seg[send_i + 1]], right,
                           buf[seg[recv_i]:seg[recv_i + 1]], left, code, TAG + P + s)
