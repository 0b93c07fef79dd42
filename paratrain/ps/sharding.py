"""Where each parameter tensor, or each piece of one, lives among S servers.

A big tensor is cut into S contiguous ranges, one per server, so pushing and
pulling it uses every server's link at once instead of queueing on one (ps-lite
splits keys by range across servers the same way: Li et al., OSDI 2014,
section 3.1). Cutting small tensors would only multiply messages, so they
stay whole and are dealt out greedily, largest first, each to the server
holding the fewest bytes so far: Graham's LPT rule, which leaves the busiest
and the idlest server no further apart than the largest small tensor.

Every worker computes the placement from the same list of tensors, with no
randomness and fixed tie-breaks, so all of them agree without talking.
"""
import collections
import dataclasses
import heapq
import operator


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of the flattened tensor number ``key`` (called ``name``), kept on ``server``."""
    key: int
    name: str
    server: int
    lo: int
    hi: int


def place(tensors, servers, split_bytes=1 << 20, itemsize=4):
    """Pieces for ``tensors`` (a list of ``(name, numel)``; key = position) over ``servers`` servers.

    Tensors of at least ``split_bytes`` bytes are split into ``servers`` nearly
    equal ranges, range i on server i (empty ranges skipped). The others stay
    whole: largest first (equal sizes in list order), each on the server with
    the fewest bytes so far, split pieces included (ties: lowest index). A
    tensor of no elements gets one empty piece, so every tensor has a home.
    Returns the pieces sorted by (key, lo).
    """
    servers = _positive(servers, "servers")
    split_bytes = _positive(split_bytes, "split_bytes")
    itemsize = _positive(itemsize, "itemsize")
    seen = set()
    sizes = []
    for key, (name, numel) in enumerate(tensors):
        if not isinstance(name, str) or name in seen:
            raise ValueError(f"tensor {key}: name {name!r} is not a str or appears twice; names must be unique")
        seen.add(name)
        numel = operator.index(numel)
        if numel < 0:
            raise ValueError(f"tensor {name!r} has numel {numel}; a tensor has >= 0 elements")
        sizes.append((name, numel))
    pieces, load = [], [0] * servers
    for key, (name, numel) in enumerate(sizes):
        if numel * itemsize >= split_bytes:
            for s in range(servers):
                lo, hi = s * numel // servers, (s + 1) * numel // servers
                if hi > lo:
                    pieces.append(Piece(key, name, s, lo, hi))
                    load[s] += (hi - lo) * itemsize
    small = sorted((k for k, (_, n) in enumerate(sizes) if n * itemsize < split_bytes),
                   key=lambda k: (-sizes[k][1], k))
    heap = [(b, s) for s, b in enumerate(load)]
    heapq.heapify(heap)  # (bytes so far, server): the least loaded, then the lowest index, pops first
    for key in small:
        name, numel = sizes[key]
        b, s = heapq.heappop(heap)
        pieces.append(Piece(key, name, s, 0, numel))
        heapq.heappush(heap, (b + numel * itemsize, s))
    return sorted(pieces, key=lambda p: (p.key, p.lo))


def _positive(value, what):
    value = operator.index(value)
    if value < 1:
        raise ValueError(f"{what} must be >= 1, not {value}")
    return value


def by_server(pieces, servers):
    """The pieces of each server: ``result[s]`` lists server s's pieces in their given order."""
    out = [[] for _ in range(_positive(servers, "servers"))]
    for p in pieces:
        if not 0 <= p.server < servers:
            raise ValueError(f"piece of {p.name!r} is on server {p.server}, but there are {servers} servers")
        out[p.server].append(p)
    return out


SHOW = 8  # tensors named per server; the rest are counted


def describe(pieces, servers, itemsize=4):
    """A small table of the placement, printed at start-up: per server, its pieces,
    bytes, and tensors (a split tensor shows its range, name[lo:hi])."""
    count = collections.Counter(p.key for p in pieces)
    split = {p.key for p in pieces if count[p.key] > 1 or p.lo > 0}
    per = by_server(pieces, servers)
    total = sum((p.hi - p.lo) * itemsize for p in pieces)
    lines = [f"parameter servers: {servers}, {len({p.key for p in pieces})} tensors, {_size(total)}",
             f"{'server':>6} {'pieces':>6} {'bytes':>10}  tensors"]
    for s, mine in enumerate(per):
        names = [f"{p.name}[{p.lo}:{p.hi}]" if p.key in split else p.name for p in mine]
        more = f" ... (+{len(names) - SHOW} more)" if len(names) > SHOW else ""
        nbytes = sum((p.hi - p.lo) * itemsize for p in mine)
        lines.append(f"{s:>6} {len(mine):>6} {_size(nbytes):>10}  {', '.join(names[:SHOW]) or '-'}{more}")
    return "\n".join(lines)


def _size(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
