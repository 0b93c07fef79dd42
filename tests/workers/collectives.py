"""Worker: every collective, op and dtype against a numpy reference.

Started by the launcher (tests/test_collectives.py). Each rank regenerates
every rank's input from a seed, so each can compute the reference itself.
Raises (and so exits non-zero) on the first wrong number.
"""
import argparse
import functools
import sys

import numpy as np
import torch

import paratrain as pt
from paratrain.comm.group import ProcessGroup

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}
TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def make(rank, n, dtype, salt=0):
    """Rank ``rank``'s input: the same on every rank, so each computes the reference.
    Made once (the checks of a run ask for the same inputs many times, and making a
    million values costs more than the collective); callers clone what they change."""
    return _made(rank, n, dtype, salt).clone()


@functools.lru_cache(maxsize=64)
def _made(rank, n, dtype, salt):
    """Values in [0.5, 1.5), or 0-3 for integers, drawn in single precision or as bytes:
    every rank draws every rank's inputs, and with large sizes drawing them in float64 is
    much of a run."""
    rng = np.random.default_rng(1000 * rank + 17 * n + salt)
    if dtype.is_floating_point:
        vals = rng.random(n, dtype=np.float32)
        vals += 0.5
    else:
        vals = rng.integers(0, 4, n, dtype=np.uint8)
    return torch.from_numpy(vals).to(dtype)


def rows(arrays):
    """The arrays (each rank's input) as the rows of one float64 array, which the
    references reduce down: stacked once for all the ops of a size."""
    if not arrays[0].numel():
        return np.zeros((len(arrays), 0))
    return np.stack([x.to(torch.float64).numpy() for x in arrays])


def ref_reduce(arrays, op, dtype):
    """What reducing ``arrays`` (a list of tensors, or their rows) by ``op`` gives in ``dtype``."""
    a = arrays if isinstance(arrays, np.ndarray) else rows(arrays)
    r = {"sum": a.sum, "avg": a.mean, "max": a.max, "min": a.min, "prod": a.prod}[op](0)
    if not dtype.is_floating_point:
        r = torch.tensor(r.astype(np.int64)).to(dtype)  # uint8 wraps like the collective
        return r
    return torch.tensor(r)


def check(got, want, what):
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    tol = TOL.get(got.dtype)
    ok = torch.equal(got, want.to(got.dtype))   # a copy (gather, broadcast, ...) is exact, and this is quick
    if not ok and tol is not None:   # torch.allclose's test, written out: 2.4x faster on large tensors
        got, want = got.to(torch.float64), want.to(torch.float64)
        ok = bool(((got - want).abs_() <= tol + tol * want.abs()).all())
    if not ok:
        raise AssertionError(f"{what}: got {got[:6].tolist()} want {want[:6].tolist()}")


def run(g, dtypes, sizes, algorithms, as_numpy):
    P, me = g.world_size, g.rank
    count = 0
    for dname in dtypes:
        dt = DTYPES[dname]

        def arg(x):
            """What the collective is given: the tensor, or with --numpy a numpy view of
            it (same memory, so the checks below read the result either way; numpy has
            no bfloat16). Lists element by element."""
            if x is None or not as_numpy or dt == torch.bfloat16:
                return x
            return [t.numpy() for t in x] if isinstance(x, list) else x.numpy()
        ops = ["sum", "max", "min", "prod"] + (["avg"] if dt.is_floating_point else [])
        for n in sizes:
            ins = [make(r, n, dt) for r in range(P)]
            ins_rows = rows(ins)
            # reduce_scatter: piece r of everyone, reduced, lands on rank r
            pieces = [make(r, n * P, dt, salt=1) for r in range(P)]
            my_pieces = rows([p[me * n:(me + 1) * n] for p in pieces])
            for op in ops:
                reduced = ref_reduce(ins_rows, op, dt)
                for algo in algorithms:
                    t = ins[me].clone()
                    g.all_reduce(arg(t), op=op, algorithm=algo)
                    check(t, reduced, f"all_reduce {dname} n={n} op={op} algo={algo}")
                    count += 1
                # reduce to the last rank; others keep their input
                t = ins[me].clone()
                g.reduce(arg(t), dst=P - 1, op=op)
                check(t, reduced if me == P - 1 else ins[me], f"reduce {dname} n={n} op={op}")
                out = torch.empty(n, dtype=dt)
                g.reduce_scatter(arg(out), arg(pieces[me].clone()), op=op)
                want = ref_reduce(my_pieces, op, dt)
                check(out, want, f"reduce_scatter {dname} n={n} op={op}")
                out = torch.empty(n, dtype=dt)   # the list form: pieces in separate tensors
                g.reduce_scatter(arg(out), arg([pieces[me][q * n:(q + 1) * n].clone() for q in range(P)]), op=op)
                check(out, want, f"reduce_scatter(list) {dname} n={n} op={op}")
                count += 3
                if op == "sum":   # in place: the output is this rank's own piece (ZeRO, FSDP); a sum
                    inp = pieces[me].clone()   # shows a piece read after it was overwritten
                    g.reduce_scatter(arg(inp[me * n:(me + 1) * n]), arg(inp), op=op)
                    check(inp[me * n:(me + 1) * n], want, f"reduce_scatter in place {dname} n={n} op={op}")
                    count += 1
            src = (n + 1) % P
            t = ins[me].clone()
            g.broadcast(arg(t), src=src)
            check(t, ins[src], f"broadcast {dname} n={n}")
            out = torch.empty(P * n, dtype=dt)
            g.all_gather(arg(out), arg(ins[me]))
            check(out, torch.cat(ins), f"all_gather(tensor) {dname} n={n}")
            outs = [torch.empty(n, dtype=dt) for _ in range(P)]
            g.all_gather(arg(outs), arg(ins[me]))
            check(torch.cat(outs), torch.cat(ins), f"all_gather(list) {dname} n={n}")
            out = torch.full((P * n,), 7, dtype=dt)   # in place: the input is this rank's piece of the output
            out[me * n:(me + 1) * n] = ins[me]
            g.all_gather(arg(out), arg(out[me * n:(me + 1) * n]))
            check(out, torch.cat(ins), f"all_gather in place {dname} n={n}")
            mine = ins[me].clone()   # the list form in place: this rank's output piece is the input
            outs = [mine if q == me else torch.full((n,), 7, dtype=dt) for q in range(P)]
            g.all_gather(arg(outs), arg(mine))
            check(torch.cat(outs), torch.cat(ins), f"all_gather(list) in place {dname} n={n}")
            dst = n % P
            gl = [torch.empty(n, dtype=dt) for _ in range(P)] if me == dst else None
            g.gather(arg(ins[me]), arg(gl), dst=dst)
            if me == dst:
                check(torch.cat(gl), torch.cat(ins), f"gather {dname} n={n}")
            mine = ins[me].clone()   # gather_list[dst] is the input itself
            gl = [mine if q == me else torch.full((n,), 7, dtype=dt) for q in range(P)] if me == dst else None
            g.gather(arg(mine), arg(gl), dst=dst)
            if me == dst:
                check(torch.cat(gl), torch.cat(ins), f"gather in place {dname} n={n}")
            sl = [make(q, n, dt, salt=2) for q in range(P)]
            t = torch.empty(n, dtype=dt)
            g.scatter(arg(t), arg(sl) if me == src else None, src=src)
            check(t, make(me, n, dt, salt=2), f"scatter {dname} n={n}")
            # all_to_all: rank r's piece j is make(r*P+j)
            send = torch.cat([make(me * P + j, n, dt, salt=3) for j in range(P)])
            recv = torch.empty(P * n, dtype=dt)
            g.all_to_all(arg(recv), arg(send))
            check(recv, torch.cat([make(q * P + me, n, dt, salt=3) for q in range(P)]), f"all_to_all {dname} n={n}")
            count += 8
    # algorithms compared with each other on the same inputs: the direct and naive ones
    # reduce in rank order, so they agree bit for bit; the others to rounding
    if len(algorithms) > 1:
        x = make(me, 30001, torch.float64, salt=5)
        results = {}
        for algo in algorithms:
            t = x.clone()
            g.all_reduce(t, algorithm=algo)
            results[algo] = t
        base = results[algorithms[0]]
        for algo, t in results.items():
            if not torch.allclose(t, base, rtol=1e-13, atol=0):
                raise AssertionError(f"algorithm {algo} disagrees with {algorithms[0]}")
        if g.backend == "shm" and "naive" in results and None in results:
            if not torch.equal(results["naive"], results[None]):
                raise AssertionError("direct and naive all_reduce differ bitwise")
    # a call refused on one rank only (a misspelt algorithm) must not leave the ranks out of step
    t = torch.full((5,), float(me + 1))
    if me == 0:
        try:
            g.all_reduce(t, algorithm="rnig")
            raise AssertionError("all_reduce accepted algorithm='rnig'")
        except ValueError:
            pass
    g.all_reduce(t)
    check(t, torch.full((5,), float(P * (P + 1) // 2)), "all_reduce after a call refused on rank 0")
    g.barrier()
    # uneven all_to_all: rank r sends j+1 elements to rank j
    dt = torch.float32
    send = [torch.full((j + 1,), float(me * 10 + j)) for j in range(P)]
    recv = [torch.empty(me + 1) for _ in range(P)]
    g.all_to_all(recv, send)
    for q in range(P):
        check(recv[q], torch.full((me + 1,), float(q * 10 + me)), "uneven all_to_all")
    # in place, as torch and MPI allow: the same tensors as input and output
    both = [torch.full((3,), float(me * 10 + j)) for j in range(P)]
    g.all_to_all(both, both)
    for q in range(P):
        check(both[q], torch.full((3,), float(q * 10 + me)), "all_to_all(list) in place")
    both = torch.cat([torch.full((5,), float(me * 10 + j)) for j in range(P)])
    g.all_to_all(both, both)
    check(both, torch.cat([torch.full((5,), float(q * 10 + me)) for q in range(P)]), "all_to_all in place")
    # point to point around a ring, blocking and async, several sizes
    if P > 1:
        for n in sizes:
            x = make(me, n, torch.float32, salt=4)
            y = torch.empty(n)
            w = g.isend(x, (me + 1) % P, tag=5)
            g.recv(y, (me - 1) % P, tag=5)
            w.wait()
            check(y, make((me - 1) % P, n, torch.float32, salt=4), f"isend/recv n={n}")
            w = g.irecv(y, (me + 1) % P, tag=6)
            g.send(x, (me - 1) % P, tag=6)
            w.wait()
            check(y, make((me + 1) % P, n, torch.float32, salt=4), f"send/irecv n={n}")
    # async collectives complete in order
    ts = [make(me, 1000, torch.float64, salt=i) for i in range(4)]
    works = [g.all_reduce(t, async_op=True) for t in ts]
    for i, (w, t) in enumerate(zip(works, ts)):
        w.wait()
        check(t, ref_reduce([make(r, 1000, torch.float64, salt=i) for r in range(P)], "sum", torch.float64),
              f"async all_reduce {i}")
    # every other collective with async_op=True, all in flight at once, then waited
    n, dt = 1001, torch.float32
    ins = [make(r, n, dt, salt=7) for r in range(P)]
    big = [make(r, n * P, dt, salt=8) for r in range(P)]
    b, red, ag, rs = ins[me].clone(), ins[me].clone(), torch.empty(P * n), torch.empty(n)
    gl = [torch.empty(n) for _ in range(P)] if me == 0 else None
    sc, a2a = torch.empty(n), torch.empty(P * n)
    works = [g.broadcast(b, src=P - 1, async_op=True), g.reduce(red, dst=0, async_op=True),
             g.all_gather(ag, ins[me], async_op=True), g.reduce_scatter(rs, big[me].clone(), async_op=True),
             g.gather(ins[me], gl, dst=0, async_op=True),
             g.scatter(sc, list(big[0].chunk(P)) if me == 0 else None, src=0, async_op=True),
             g.all_to_all(a2a, big[me].clone(), async_op=True), g.barrier(async_op=True)]
    for w in works:
        w.wait()
    check(b, ins[P - 1], "async broadcast")
    check(red, ref_reduce(ins, "sum", dt) if me == 0 else ins[me], "async reduce")
    check(ag, torch.cat(ins), "async all_gather")
    check(rs, ref_reduce([x[me * n:(me + 1) * n] for x in big], "sum", dt), "async reduce_scatter")
    if me == 0:
        check(torch.cat(gl), torch.cat(ins), "async gather")
    check(sc, big[0][me * n:(me + 1) * n], "async scatter")
    check(a2a, torch.cat([x[me * n:(me + 1) * n] for x in big]), "async all_to_all")
    count += 8
    g.barrier()
    return count


class PointToPointOnly(ProcessGroup):
    """A backend with nothing but send and recv (borrowed from a real group): every
    collective then takes ProcessGroup's portable versions over point to point
    (ring or tree all_reduce by size, tree broadcast/reduce/barrier, naive gather,
    scatter, all_gather, reduce_scatter, all_to_all), the ones a new backend gets
    before it has native collectives."""
    backend = "p2p"

    def __init__(self, inner):
        super().__init__(inner.rank, inner.world_size, inner.ranks, inner.timeout)
        self.inner = inner

    def _send(self, buf, code, dst, tag):
        self.inner.transport.send(buf, code, dst, tag)

    def _recv(self, buf, code, src, tag):
        self.inner.transport.recv(buf, code, src, tag)


def big_all_reduce(g, dtypes, n, algorithms=(None,)):
    """Large all-reduces of private tensors against numpy, with each algorithm asked
    for (large enough for ring's pipelined chunks and cma.all_reduce); with 2 ranks
    bit for bit (a + b == b + a, whichever rank reduced a slice)."""
    P, me = g.world_size, g.rank
    count = 0
    for dname in dtypes:
        dt = DTYPES[dname]
        ins = [make(r, n, dt, salt=9) for r in range(P)]
        ins_rows = rows(ins)
        ops = ("sum", "max", "avg") if dt.is_floating_point else ("sum", "max")
        for op in ops:
            want = ref_reduce(ins_rows, op, dt)
            for algo in algorithms:
                t = ins[me].clone()
                g.all_reduce(t, op=op, algorithm=algo)
                check(t, want, f"big all_reduce {dname} n={n} op={op} algo={algo}")
                if P == 2 and op == "sum" and not torch.equal(t, ins[0] + ins[1]):
                    raise AssertionError(f"big all_reduce {dname} algo={algo}: not bit-identical to a + b")
            count += len(algorithms)
    return count


def barrier_holds(g):
    """No rank leaves a barrier before the last one entered it: rank 0 enters late and
    says when (a barrier that returned at once would let the others out before
    that). Blocking and async_op=True. One host's clock, so the times compare."""
    import time
    for blocking in (True, False):
        entered = np.zeros(1, np.float64)
        if g.rank == 0:
            time.sleep(0.2)
            entered[0] = time.time()
        if blocking:
            g.barrier()
        else:
            g.barrier(async_op=True).wait()
        left = time.time()
        g.broadcast(entered, src=0)
        if left < entered[0]:
            raise AssertionError(f"rank {g.rank} left the {'blocking' if blocking else 'async'} barrier "
                                 f"{(entered[0] - left) * 1e3:.0f} ms before rank 0 entered it")
    return 2


def algorithm_from_env(g, expected):
    """All-reduces that name no algorithm, small and large (both sides of every
    backend's size switch), against numpy, checking that each ran PARATRAIN_ALGO's
    algorithm: the algorithm modules' all_reduce are wrapped to log their names, and
    ``expected`` "native" means none of them ran (the backend's own)."""
    from paratrain.comm.group import ALGORITHMS
    ran = []
    for name, module in ALGORITHMS.items():
        def logged(*args, _name=name, _inner=module.all_reduce, **kwargs):
            ran.append(_name)
            return _inner(*args, **kwargs)
        module.all_reduce = logged
    P, me = g.world_size, g.rank
    for n in (7, 100003, 600011):
        ins = [make(r, n, torch.float32, salt=3) for r in range(P)]
        t = ins[me].clone()
        ran.clear()
        g.all_reduce(t)
        check(t, ref_reduce(ins, "sum", torch.float32), f"all_reduce n={n} with PARATRAIN_ALGO={expected}")
        if ran != ([] if expected == "native" else [expected]):
            raise AssertionError(f"all_reduce of {n} float32 with PARATRAIN_ALGO={expected}: the algorithms "
                                 f"that ran were {ran or 'only the native one'}")
    return 3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--sizes", default="0,1,7,1000,100003")
    ap.add_argument("--algorithms", default="")
    ap.add_argument("--numpy", action="store_true",
                    help="pass numpy arrays instead of tensors to every collective of the dtype loop")
    ap.add_argument("--subgroup", action="store_true", help="also run on a sub-group of the odd ranks")
    ap.add_argument("--portable", action="store_true",
                    help="also run over a group with only send/recv (ProcessGroup's portable collectives)")
    ap.add_argument("--expect-single-copy", choices=("yes", "no"), default=None,
                    help="check whether large all_gathers and all_reduces read peers' memory directly "
                         "(shm/cma.py)")
    ap.add_argument("--expect-env-algorithm", default=None,
                    help="check that all_reduce without an algorithm runs this one (PARATRAIN_ALGO), or 'native'")
    ap.add_argument("--big-all-reduce", type=int, default=0,
                    help="also all-reduce this many elements of each dtype (large enough for cma.all_reduce)")
    a = ap.parse_args()
    g = pt.init(backend=a.backend)
    assert pt.init() is g   # a second init returns the same world, and refuses another backend
    try:
        pt.init(backend="mpi")
    except pt.CommError as e:
        if "already initialized" not in str(e):
            raise
    else:
        raise AssertionError(f"pt.init(backend='mpi') on a {g.backend} world went through")
    algos = [x or None for x in a.algorithms.split(",")]
    sizes = [int(s) for s in a.sizes.split(",")]
    n = run(g, a.dtypes.split(","), sizes, algos, a.numpy)
    n += barrier_holds(g)
    if a.expect_env_algorithm:
        n += algorithm_from_env(g, a.expect_env_algorithm)
    if a.big_all_reduce:
        n += big_all_reduce(g, a.dtypes.split(","), a.big_all_reduce, algos)
    if a.portable:
        p2p = PointToPointOnly(g)
        n += run(p2p, a.dtypes.split(","), sizes, [None, "ring", "tree", "naive"], a.numpy)
        p2p.destroy()
    sub = None
    if a.subgroup and g.world_size >= 3:
        members = list(range(1, g.world_size, 2)) + [0]
        sub = pt.new_group(members)
        # members get the group, ranked in increasing global rank as torch sorts them; the others None
        assert (sub is not None) == (g.rank in members), f"rank {g.rank}: new_group({members}) gave {sub!r}"
        if sub is not None:
            assert (sub.world_size, sub.rank) == (len(members), sorted(members).index(g.rank)), sub
            n += run(sub, ["float32", "int64"], [0, 5, 1001], [None], False)
            n += barrier_holds(sub)
        g.barrier()
    if a.expect_single_copy is not None:
        used = getattr(g, "_cma_ok", None)
        if used != (a.expect_single_copy == "yes"):
            raise AssertionError(f"single-copy all_gather: expected {a.expect_single_copy}, the group decided {used}")
    leaders = getattr(g, "leaders", None)   # hierarchical: the engine between host leaders
    if leaders is not None:
        print(f"rank {g.rank}: host leaders talk over {leaders.backend}", flush=True)
    pt.destroy()
    for group in [x for x in (g, sub) if x is not None]:
        try:   # a destroyed group refuses calls instead of talking to peers that may have left
            group.all_reduce(torch.ones(3))
        except pt.CommError as e:
            if "destroyed" not in str(e):
                raise
        else:
            raise AssertionError(f"all_reduce on {group!r} after pt.destroy() went through")
        try:   # nor hands out shared memory
            group.empty_shared(4)
        except pt.CommError as e:
            if "destroyed" not in str(e):
                raise
        else:
            raise AssertionError(f"empty_shared on {group!r} after pt.destroy() went through")
    print(f"rank {g.rank}: {n} collective checks passed on {g.backend}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
