"""Every rank's clock read as rank 0's: the offset, estimated the way NTP does.

Rank r sends its time t0 to rank 0, rank 0 answers with its own time t1, and
r notes t2 when the answer is in. If the two legs took equally long, rank 0
read t1 at r's (t0 + t2) / 2, so the offset is t1 - (t0 + t2) / 2, known to
within half the round trip (Cristian, "Probabilistic clock synchronization",
Distributed Computing 1989; Mills, RFC 5905). Of several round trips the
shortest is kept: its legs had the least room to differ.

On one host every process reads the same monotonic clock and the offsets
come out within their uncertainty of zero; across hosts they line the same
collective up on every rank's row of the trace.
"""
import time

import numpy as np

ROUNDS = 8


def best_offset(samples):
    """(offset, uncertainty) from (t0, t1, t2) samples: the one of the shortest round trip."""
    t0, t1, t2 = min(samples, key=lambda s: s[2] - s[0])
    return t1 - (t0 + t2) / 2, (t2 - t0) / 2


def estimate(group, rounds=ROUNDS, clock=time.perf_counter):
    """(offset_s, uncertainty_s) of this rank's clock to rank 0's; every rank of
    ``group`` calls it together (rank 0 gets (0, 0))."""
    me, ping = group.rank, np.zeros(1, np.float64)
    if me == 0:
        for peer in range(1, group.world_size):
            for _ in range(rounds):
                group.recv(ping, peer)
                ping[0] = clock()
                group.send(ping, peer)
        return 0.0, 0.0
    samples = []
    for _ in range(rounds):
        t0 = clock()
        ping[0] = t0
        group.send(ping, 0)
        group.recv(ping, 0)
        samples.append((t0, float(ping[0]), clock()))
    return best_offset(samples)
