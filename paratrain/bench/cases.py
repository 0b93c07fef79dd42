"""One (collective, size) case: the buffers every engine shares, and the answer to check.

Sizes follow nccl-tests (doc/PERFORMANCE.md in NVIDIA/nccl-tests): ``nbytes``
is the whole buffer of the collective. For all_reduce and broadcast that is
the buffer itself (reduce too); for all_gather and gather it is the *output*
(world_size x each rank's input), for reduce_scatter and scatter the *input*
(world_size x each rank's output), and for all_to_all each rank's send (and
receive) buffer. Rooted collectives use root 0. The element type is float32.

Inputs are small integers ((i mod 13) plus a rank term), so every sum is exact
in float32 and the check is an exact comparison with numpy: no tolerance
behind which a wrong answer could hide.
"""
import numpy as np

DTYPE = np.float32
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
               "all_to_all")
ROOT = 0


def elements(nbytes, world_size):
    """Whole elements, divisible by the world size (at least one per rank)."""
    per_rank = max(1, nbytes // np.dtype(DTYPE).itemsize // world_size)
    return per_rank * world_size


def _pattern(n, offset=0):
    return (np.arange(offset, offset + n, dtype=np.int64) % 13).astype(DTYPE)


def _filled(buf, values):
    buf[...] = values
    return buf


class Case:
    """``alloc(n)`` makes the buffers the engines work on (zeroed float32 arrays): private
    memory by default, or paratrain's shared memory (``--buffers shared``)."""

    def __init__(self, collective, nbytes, world_size, rank, alloc=None):
        alloc = alloc or (lambda k: np.zeros(k, DTYPE))
        if collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")
        self.collective, self.P, self.rank = collective, world_size, rank
        self.count = elements(nbytes, world_size)
        self.nbytes = self.count * np.dtype(DTYPE).itemsize
        n, P, r = self.count, world_size, rank
        if collective in ("all_reduce", "reduce"):
            self.pristine = _pattern(n) + (r + 1)
            self.buf = _filled(alloc(n), self.pristine)
        elif collective == "broadcast":
            self.pristine = _pattern(n) + 1 if r == ROOT else np.zeros(n, DTYPE)
            self.buf = _filled(alloc(n), self.pristine)
        elif collective in ("all_gather", "gather"):
            self.inp = _filled(alloc(n // P), _pattern(n // P) + 16 * r)
            self.out = alloc(n)
        elif collective == "scatter":
            self.inp = _filled(alloc(n), _pattern(n) + 1)   # only the root's is sent
            self.out = alloc(n // P)
        elif collective == "all_to_all":   # piece j of rank r's input goes to rank j
            m = n // P
            self.inp = _filled(alloc(n), np.concatenate([_pattern(m, offset=j * m) + 16 * r for j in range(P)]))
            self.out = alloc(n)
        else:  # reduce_scatter
            self.inp = _filled(alloc(n), _pattern(n) + (r + 1))
            self.out = alloc(n // P)

    def reset(self):
        """In-place collectives overwrite their input: restore it before each call
        (outside the timed region), so every call reduces the same numbers and
        repeated sums never drift towards overflow."""
        if self.collective in ("all_reduce", "broadcast", "reduce"):
            np.copyto(self.buf, self.pristine)

    def call(self, engine):
        c = self.collective
        if c == "all_reduce":
            engine.all_reduce(self.buf)
        elif c == "reduce":
            engine.reduce(self.buf, ROOT)
        elif c == "broadcast":
            engine.broadcast(self.buf, ROOT)
        elif c == "gather":
            engine.gather(self.out, self.inp, ROOT)
        elif c == "scatter":
            engine.scatter(self.out, self.inp, ROOT)
        else:   # all_gather, reduce_scatter, all_to_all: (out, inp)
            getattr(engine, c)(self.out, self.inp)

    def check(self, engine):
        """One call from a state where a do-nothing engine would be caught; True if exact."""
        self.reset()
        if hasattr(self, "out"):
            self.out.fill(-1)
        self.call(engine)
        n, P, r = self.count, self.P, self.rank
        if self.collective == "all_reduce":
            ok = np.array_equal(self.buf, P * _pattern(n) + P * (P + 1) // 2)
        elif self.collective == "broadcast":
            ok = np.array_equal(self.buf, _pattern(n) + 1)
        elif self.collective == "reduce":   # only the root's buffer is defined afterwards
            ok = r != ROOT or np.array_equal(self.buf, P * _pattern(n) + P * (P + 1) // 2)
        elif self.collective in ("all_gather", "gather"):
            m = n // P
            ok = (self.collective == "gather" and r != ROOT) or \
                all(np.array_equal(self.out[q * m:(q + 1) * m], _pattern(m) + 16 * q) for q in range(P))
        elif self.collective == "scatter":
            m = n // P
            ok = np.array_equal(self.out, _pattern(m, offset=r * m) + 1)
        elif self.collective == "all_to_all":
            m = n // P
            ok = all(np.array_equal(self.out[q * m:(q + 1) * m], _pattern(m, offset=r * m) + 16 * q)
                     for q in range(P))
        else:
            m = n // P
            ok = np.array_equal(self.out, P * _pattern(m, offset=r * m) + P * (P + 1) // 2)
        return bool(ok)
