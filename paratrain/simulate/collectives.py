"""What each collective costs, by algorithm: the alpha-beta-gamma model of paratrain's own algorithms.

Hockney's model with a reduction term, as Thakur, Rabenseifner & Gropp use it
("Optimization of collective communication operations in MPICH", IJHPCA 2005):
sending a message of n bytes over a link costs ``alpha + n beta``, and
reducing n bytes costs ``n gamma``. An algorithm's cost is then three counts
on its critical path - latency steps, bytes each rank sends, bytes each rank
reduces - times the link's three constants (``Terms.seconds``). The counts
are those the algorithms' own docstrings give (comm/algorithms/ring.py,
tree.py, naive.py, comm/shm/direct.py, comm/hierarchical.py), here in one
table so that a step's communication can be predicted for any P and n.

``n`` is the buffer's bytes on each rank (for all_gather, the gathered
output's; for reduce_scatter, the input's), P the ranks.
"""
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Link:
    """alpha: seconds per message; beta: seconds per byte sent; gamma: seconds per byte reduced.

    A link that is memory (shared memory inside a host) has two rates: copies and
    reductions over a working set that fits a core's cache run at beta and gamma, and
    the share of the bytes beyond ``cache_bytes`` costs ``beyond`` seconds a byte more,
    streamed from the shared cache or DRAM. ``cache_bytes`` 0: one rate for all sizes
    (a network link, whose wire is slower than either). With ``cliff``, a working set
    past the cache streams every byte from beyond it: a buffer swept in order through a
    least-recently-used cache smaller than it misses on every line, each evicted before
    it is used again (ranks sharing a core evict each other's lines between sweeps).

    ``floor``: seconds a collective over the link takes at least. A rate-limited link (a
    token bucket, as a pretend host's loopback is limited) lets a burst through at once:
    a small message goes at the pace of the path under the bucket (here Gloo and the
    kernel's TCP, about 2 ms a call on 2 cores), a large one at the bucket's rate, and a
    call takes the slower of the two, not their sum."""
    alpha: float
    beta: float
    gamma: float = 0.0
    cache_bytes: float = 0.0
    beyond: float = 0.0
    cliff: bool = False
    floor: float = 0.0

    def far_share(self, footprint):
        """The share of a ``footprint``-byte working set's traffic past the cache."""
        if not self.cache_bytes or footprint <= self.cache_bytes:
            return 0.0
        return 1.0 if self.cliff else 1.0 - self.cache_bytes / footprint

    @classmethod
    def from_rates(cls, gbps, latency_us, reduce_gbps=None):
        """A link of ``gbps`` gigabits per second and ``latency_us`` microseconds per message;
        reductions at ``reduce_gbps`` gigabits per second (None: free)."""
        return cls(latency_us * 1e-6, 8 / (gbps * 1e9), 8 / (reduce_gbps * 1e9) if reduce_gbps else 0.0)

    def slowed(self, k):
        """This link when each rank has 1/k of a core (k ranks to a core): every term k times."""
        return self if k == 1 else Link(self.alpha * k, self.beta * k, self.gamma * k, self.cache_bytes,
                                        self.beyond * k, self.cliff, self.floor * k)


@dataclass(frozen=True)
class Terms:
    """A cost as counts on the critical path: latency steps, bytes sent and bytes reduced per
    rank; ``footprint``, the bytes of a rank's buffer they work over (which rate a
    two-rate link charges; not part of the counts' equality)."""
    steps: float
    sent: float
    reduced: float = 0.0
    footprint: float = field(default=0.0, compare=False)

    def seconds(self, link):
        cost = (self.steps * link.alpha + self.sent * link.beta + self.reduced * link.gamma
                + self.far_bytes(link) * link.beyond)
        return max(link.floor, cost) if self.steps else cost   # (no steps: no call over the link)

    def far_bytes(self, link):
        """Bytes moved (sent or reduced) from beyond ``link``'s cache."""
        return (self.sent + self.reduced) * link.far_share(self.footprint)

    def __add__(self, other):
        return Terms(self.steps + other.steps, self.sent + other.sent, self.reduced + other.reduced,
                     max(self.footprint, other.footprint))


NOTHING = Terms(0, 0, 0)


def _log2_steps(P):
    """Recursive doubling's steps: log2 of the largest power of two <= P, plus two when
    P is not one (the extra ranks fold in first and get the result back last)."""
    k = P.bit_length() - 1
    return k, (2 if P != 1 << k else 0)


def ring_all_reduce(P, n):
    """Scatter-reduce then all-gather around the ring: 2(P-1) steps, 2(P-1)/P n sent."""
    if P == 1:
        return NOTHING
    return Terms(2 * (P - 1), 2 * (P - 1) / P * n, (P - 1) / P * n, n)


def tree_all_reduce(P, n):
    """Recursive doubling: every step exchanges and combines the whole buffer."""
    if P == 1:
        return NOTHING
    k, extra = _log2_steps(P)
    return Terms(k + extra, (k + extra) * n, (k + (1 if extra else 0)) * n, n)


def naive_all_reduce(P, n):
    """Gather to rank 0, reduce there, send back: the root's P-1 receives and P-1 sends."""
    if P == 1:
        return NOTHING
    return Terms(2 * (P - 1), 2 * (P - 1) * n, (P - 1) * n, n)


SLOT_BYTES = 1 << 20      # comm/shm: a round of the direct algorithm moves at most this much per rank
SMALL_BYTES = 512 << 10   # comm/shm/direct.py: below it (times P-1), every rank reduces the whole message


def direct_all_reduce(P, n, slot_bytes=SLOT_BYTES):
    """Shared memory (comm/shm/direct.py); bytes are memory traffic, so beta here is a
    memcpy's seconds per byte and gamma a reduction's. A small message is copied in whole,
    one barrier, and every rank reduces all P inputs. A larger one goes in rounds of
    ``slot_bytes``, pipelined one barrier per round (R + 1 for R rounds): per rank the
    (P-1)/P others reduce is copied in, its own part reduced from every input (n read)
    and copied back (n/P), and the other (P-1)/P copied out."""
    if P == 1:
        return NOTHING
    if n <= slot_bytes and n * (P - 1) <= SMALL_BYTES:
        return Terms(1, n, P * n, n)
    rounds = max(1, math.ceil(n / slot_bytes))
    return Terms(rounds + 1, (2 * (P - 1) / P + 1 / P) * n, n, n)


def direct_broadcast(P, n, slot_bytes=SLOT_BYTES):
    """Shared memory (comm/shm/direct.py): per round of ``slot_bytes`` the root copies its
    part in, one barrier, and the others copy it out while the root copies the next round
    in (three slots a rank): n and then the last round's n / R on the critical path."""
    if P == 1:
        return NOTHING
    rounds = max(1, math.ceil(n / slot_bytes))
    return Terms(rounds, n + n / rounds, 0.0, n)


def busy_ranks(algorithm, P):
    """How many of P ranks work at once in ``algorithm``'s all-reduce: all of them, but for
    recursive doubling at a P that is not a power of two, whose extra ranks fold in and
    then wait while 2^k exchange. Ranks that share cores contend only as many as work."""
    return 1 << (P.bit_length() - 1) if algorithm == "tree" and P > 1 else P


ALL_REDUCE = {"ring": ring_all_reduce, "tree": tree_all_reduce, "naive": naive_all_reduce,
              "direct": direct_all_reduce}


def all_reduce(algorithm, P, n):
    try:
        return ALL_REDUCE[algorithm](P, n)
    except KeyError:
        raise ValueError(f"no cost model for all_reduce algorithm {algorithm!r}; "
                         f"known: {', '.join(ALL_REDUCE)}") from None


def all_gather(P, n):
    """Ring all-gather of an n-byte output: P-1 steps, each rank sends (P-1)/P of it."""
    return Terms(P - 1, (P - 1) / P * n, 0.0, n) if P > 1 else NOTHING


def reduce_scatter(P, n):
    """Ring reduce-scatter of an n-byte input: P-1 steps, (P-1)/P of it sent and reduced."""
    return Terms(P - 1, (P - 1) / P * n, (P - 1) / P * n, n) if P > 1 else NOTHING


def broadcast(P, n):
    """Binomial tree: ceil(log2 P) steps, the whole buffer each."""
    steps = math.ceil(math.log2(P)) if P > 1 else 0
    return Terms(steps, steps * n, 0.0, n)


def hierarchical_all_reduce(hosts, per_host, n, intra, inter, inter_algorithm="ring"):
    """Seconds of comm/hierarchical.py's all-reduce: reduce inside each host to its leader,
    all-reduce among the host leaders over ``inter``, broadcast inside each host; ``intra``
    is the host's shared-memory link (beta a memcpy's). Horovod's hierarchical all-reduce
    (Sergeev & Del Balso, arXiv 1802.05799): the network carries one buffer per host.
    Inside, the reduce is the direct all-reduce with one rank keeping the result (its
    critical path the same) and the broadcast is direct too."""
    inside = direct_all_reduce(per_host, n) + direct_broadcast(per_host, n)
    return inside.seconds(intra) + all_reduce(inter_algorithm, hosts, n).seconds(inter)
