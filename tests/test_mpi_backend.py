"""The MPI backend, end to end: this file is also the worker that mpirun starts.

Every rank builds every rank's input from a seed, so each one computes the
numpy reference of every collective by itself and raises on the first
mismatch; the test asserts the job exits 0. The pytest process never imports
mpi4py (that would initialise MPI in it).
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import flight_env, launch

MPIRUN = shutil.which("mpirun", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or MPIRUN is None,
                                reason="needs mpi4py and mpirun (pip install paratrain[mpi])")

SEED = 20240611
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "int32": torch.int32, "uint8": torch.uint8}
LENGTHS = (0, 1, 7, 1001)
OPS = ("sum", "avg", "max", "min", "prod")
NP_OPS = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min, "prod": np.prod}
TOL = {"float32": 1e-6, "float64": 1e-12, "bfloat16": 1e-2, "float16": 1e-3}


def _mpirun_env(**settings):
    """This process's environment for an mpirun job, with ``settings`` on top: without
    the launcher's rank variables (mpirun sets its own) and without a backend or
    algorithm chosen from outside; its flight recorders write under the run's pytest folder."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PARATRAIN_BACKEND", "PARATRAIN_ALGO")}
    env.update(flight_env(), **settings)
    return env


# One mpirun of 3 ranks runs these one after another, each with its own pt.init and pt.destroy:
# Open MPI and torch start once for them. name -> (tests/workers script, or None for this
# file's worker(); the environment it runs with).
PHASES = {
    "collectives-debug": (None, {"PARATRAIN_DEBUG": "1"}),
    "p2p": ("p2p_matching.py", {"PARATRAIN_DEBUG": "0"}),
    "p2p-debug": ("p2p_matching.py", {"PARATRAIN_DEBUG": "1"}),
    "reinit": ("reinit.py", {"PARATRAIN_DEBUG": "0"}),
    "silent": ("silent_peer.py", {"PARATRAIN_DEBUG": "0", "PARATRAIN_TIMEOUT": "2"}),   # last: rank 1 sleeps on
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [1, 2, 5], ids=["np1", "np2", "np5"])
def test_mpi_backend(nprocs):
    env = _mpirun_env(PARATRAIN_TIMEOUT="30", PARATRAIN_THREADS="1", OMP_NUM_THREADS="1", PARATRAIN_DEBUG="0")
    # "-m mpi4py" aborts the whole job when one rank raises, instead of leaving the others waiting.
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(nprocs), sys.executable, "-m", "mpi4py",
           __file__]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    assert p.stdout.count("checks passed") == nprocs, p.stdout


@pytest.fixture(scope="module")
def three_ranks():
    """Every phase of PHASES in one mpirun of 3 ranks; its CompletedProcess."""
    env = _mpirun_env(PARATRAIN_TIMEOUT="30", PARATRAIN_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "--tag-output", "-n", "3", sys.executable, "-m",
           "mpi4py", __file__, ",".join(PHASES)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)


def _phase_passed(job, name, passed, printers=3):
    """Every rank ended phase ``name`` of the three_ranks job, and ``printers`` of them printed
    ``passed`` in it. Each line is tagged with its rank (mpirun --tag-output): the ranks'
    streams reach mpirun separately, so only a rank's own lines keep their order."""
    out = f"exit {job.returncode}\n--- stdout\n{job.stdout}\n--- stderr\n{job.stderr[-4000:]}"
    order = list(PHASES)
    before = order[order.index(name) - 1] if order.index(name) else None
    printed = 0
    for rank in range(3):
        lines = [line for line in job.stdout.splitlines() if line.startswith(f"[1,{rank}]<stdout>:")]
        ends = [i for i, line in enumerate(lines) if line.endswith(f"phase {name} ended")]
        assert len(ends) == 1, f"rank {rank} did not end phase {name}\n{out}"
        start = next((i for i, line in enumerate(lines) if before and line.endswith(f"phase {before} ended")), -1)
        printed += sum(passed in line for line in lines[start + 1:ends[0]])
    assert printed == printers, out


@pytest.mark.timeout(180)
def test_every_collective_on_three_ranks_with_debug_checks(three_ranks):
    """This file's checks (worker() below) on 3 ranks with PARATRAIN_DEBUG=1, which adds
    the check that ranks calling with different shapes all fail loudly."""
    _phase_passed(three_ranks, "collectives-debug", "checks passed")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("debug", ["0", "1"])
def test_point_to_point_matches_by_peer_and_tag_over_mpi(three_ranks, debug):
    """tests/workers/p2p_matching.py under mpirun: receives from two peers in either
    order, a later tag received first (its message over the eager limit), a user's
    message pending through collectives, a wrong-size message refused; with
    PARATRAIN_DEBUG=1 (envelopes.py) a message of another dtype refused too."""
    _phase_passed(three_ranks, "p2p-debug" if debug == "1" else "p2p", "p2p matching checks passed on mpi")


@pytest.mark.timeout(180)
def test_init_again_after_destroy_over_mpi(three_ranks):
    """tests/workers/reinit.py under mpirun: three rounds of pt.init(backend="mpi"),
    collectives on the world and a sub-group, pt.destroy(), old groups kept."""
    _phase_passed(three_ranks, "reinit", "re-init checks passed on mpi")


@pytest.mark.timeout(180)
def test_irecvs_from_a_silent_peer_time_out_together_over_mpi(three_ranks):
    """tests/workers/silent_peer.py under mpirun: four pending irecvs all time out
    about one timeout after they were posted, not one timeout after another."""
    _phase_passed(three_ranks, "silent", "silent peer checks passed", printers=1)


@pytest.mark.timeout(90)
def test_mpi_backend_outside_mpirun_refuses_a_larger_world():
    """`paratrain run -n 2` starting a script that asks for backend='mpi': each process
    is an MPI world of one, which must not compute alone (an all_reduce of ones would
    give 1): each refuses, saying to start the job with mpirun."""
    res = launch(2, "reinit.py", "mpi", env={"PARATRAIN_TIMEOUT": "10"})
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-4000:]
    assert "found an MPI world of 1 process(es), but WORLD_SIZE=2" in out and "mpirun -n 2" in out, out[-4000:]


@pytest.mark.timeout(120)
def test_hierarchical_with_mpi_between_host_leaders():
    """PARATRAIN_CROSS_BACKEND=mpi: shm inside each of 2 pretend hosts, MPI between
    their leaders, under mpirun; every collective against numpy (tests/workers/collectives.py)."""
    from paratrain.launch.local import free_port
    env = _mpirun_env(PARATRAIN_TIMEOUT="30", PARATRAIN_THREADS="1", OMP_NUM_THREADS="1",
                      PARATRAIN_PRETEND_HOSTS="2", PARATRAIN_CROSS_BACKEND="mpi", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), OMPI_MCA_mpi_yield_when_idle="1")
    worker = Path(__file__).parent / "workers" / "collectives.py"
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", "4", sys.executable, "-m", "mpi4py", str(worker),
           "--algorithms", ",ring", "--dtypes", "float32,float64,int64,uint8", "--sizes", "0,7,1000,100003",
           "--subgroup"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    assert p.stdout.count("collective checks passed on hierarchical") == 4, p.stdout
    assert p.stdout.count("host leaders talk over mpi") == 2, p.stdout   # ranks 0 and 2 lead the two hosts


@pytest.mark.timeout(60)
def test_rank_killed_inside_an_mpi_collective_ends_the_job_naming_it():
    """Under mpirun a dead rank is mpirun's to handle: it stops the whole job and names
    the rank, so the survivors looping in all-reduces over the mpi backend neither
    hang nor wait for paratrain's 120 s timeout (tests/workers/failures.py die_mid)."""
    env = _mpirun_env(PARATRAIN_BACKEND="mpi", PARATRAIN_TIMEOUT="120", PARATRAIN_THREADS="1",
                      OMPI_MCA_mpi_yield_when_idle="1")
    worker = Path(__file__).parent / "workers" / "failures.py"
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", "3", sys.executable, str(worker), "die_mid"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=50)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert out.count("looping") == 3, out   # all three were inside the all-reduce loop
    assert "rank 1" in out and "signal 9" in out, out


# ---- the worker -----------------------------------------------------------------------


def data(rank, n, dtype, salt):
    """Rank ``rank``'s input for the call named by ``salt``: small integers, so sums,
    products and bfloat16 are exact and every rank can rebuild it."""
    rng = np.random.default_rng([SEED, rank, n, zlib.crc32(str(salt).encode())])
    low = 0 if dtype == "uint8" else -4   # small: sums, and products in float16/bfloat16, stay exact
    return torch.from_numpy(rng.integers(low, 5, size=n).astype(np.float64)).to(DTYPES[dtype])


def f64(t):
    return t.to(torch.float64).numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float64)


class Checker:
    def __init__(self, rank):
        self.rank, self.count = rank, 0

    def eq(self, got, want, what, dtype="int64", op="sum"):
        got, want = f64(got), f64(want)
        ok = got.shape == want.shape and (
            np.allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype]) if op == "avg" else np.array_equal(got, want))
        if not ok:
            raise AssertionError(f"rank {self.rank}: {what}: got {got[:8]}... want {want[:8]}...")
        self.count += 1


def reference(P, n, dtype, salt, op):
    stack = np.stack([f64(data(q, n, dtype, salt)) for q in range(P)]) if n else np.zeros((P, 0))
    out = NP_OPS[op](stack, axis=0)
    return out % 256 if dtype == "uint8" else out   # uint8 wraps, as in C, numpy and torch (5 ranks' products)


def ops_for(dtype):
    return [op for op in OPS if not (op == "avg" and not DTYPES[dtype].is_floating_point)]


def check_all_reduce(g, c):
    P, r = g.world_size, g.rank
    for dtype in DTYPES:
        for n in LENGTHS:
            for op in ops_for(dtype):
                for algo in ("native", "ring", "tree", "naive"):
                    salt = ("all_reduce", op, algo)
                    t = data(r, n, dtype, salt)
                    g.all_reduce(t, op=op, algorithm=algo)
                    c.eq(t, reference(P, n, dtype, salt, op), f"all_reduce {dtype} x{n} {op} {algo}", dtype, op)
    with pytest.raises(ValueError, match="ambiguous"):
        g.all_reduce(data(r, 3, "int64", "x"), op="avg")
    for dtype, n in (("float32", 300_001), ("bfloat16", 100_003)):  # several ring pipeline chunks
        for algo in ("native", "ring"):
            t = data(r, n, dtype, ("big", algo))
            g.all_reduce(t, algorithm=algo)
            c.eq(t, reference(P, n, dtype, ("big", algo), "sum"), f"all_reduce {dtype} x{n} {algo}", dtype)
    # numpy input, and several async calls in flight at once
    a = f64(data(r, 5, "float64", "np")).copy()
    g.all_reduce(a, op="max")
    c.eq(a, reference(P, 5, "float64", "np", "max"), "all_reduce numpy")
    ts = [data(r, 9, "float32", ("async", i)) for i in range(4)]
    works = [g.all_reduce(t, async_op=True) for t in ts]
    for i, (t, w) in enumerate(zip(ts, works)):
        w.wait()
        c.eq(t, reference(P, 9, "float32", ("async", i), "sum"), "async all_reduce")


def check_broadcast_reduce(g, c):
    P, r = g.world_size, g.rank
    for dtype in DTYPES:
        for n in LENGTHS:
            for root in range(P):
                t = data(r, n, dtype, ("bcast", root))
                g.broadcast(t, src=root)
                c.eq(t, data(root, n, dtype, ("bcast", root)), f"broadcast {dtype} x{n} from {root}")
                for op in ops_for(dtype):
                    salt = ("reduce", root, op)
                    t = data(r, n, dtype, salt)
                    g.reduce(t, dst=root, op=op)
                    want = reference(P, n, dtype, salt, op) if r == root else data(r, n, dtype, salt)
                    c.eq(t, want, f"reduce {dtype} x{n} {op} to {root}", dtype, op if r == root else "sum")


def check_gathers(g, c):
    P, r = g.world_size, g.rank
    for dtype in DTYPES:
        for n in LENGTHS:
            mine = data(r, n, dtype, "ag")
            everyone = [data(q, n, dtype, "ag") for q in range(P)]
            out = [torch.full((n,), -9, dtype=DTYPES[dtype]) for _ in range(P)]
            g.all_gather(out, mine)
            for q in range(P):
                c.eq(out[q], everyone[q], f"all_gather list {dtype} x{n} piece {q}")
            flat = torch.zeros(P * n, dtype=DTYPES[dtype])
            g.all_gather(flat, mine)
            c.eq(flat, torch.cat(everyone), f"all_gather flat {dtype} x{n}")
            flat = torch.zeros(P * n, dtype=DTYPES[dtype])
            flat[r * n:(r + 1) * n] = mine
            g.all_gather(flat, flat[r * n:(r + 1) * n])  # in place, as ZeRO gathers its shards
            c.eq(flat, torch.cat(everyone), f"all_gather in place {dtype} x{n}")
            mine = data(r, n, dtype, "ag")   # the list form in place: out[r] is the input itself
            out = [mine if q == r else torch.full((n,), -9, dtype=DTYPES[dtype]) for q in range(P)]
            g.all_gather(out, mine)
            c.eq(torch.cat(out), torch.cat(everyone), f"all_gather list in place {dtype} x{n}")
            for root in range(P):
                mine = data(r, n, dtype, "ag")   # gather_list[root] is the root's input itself
                gl = [mine if q == r else torch.full((n,), -9, dtype=DTYPES[dtype]) for q in range(P)] \
                    if r == root else None
                g.gather(mine, gl, dst=root)
                if r == root:
                    c.eq(torch.cat(gl), torch.cat(everyone), f"gather list in place {dtype} x{n} to {root}")
                gl = [torch.full((n,), -9, dtype=DTYPES[dtype]) for _ in range(P)] if r == root else None
                g.gather(data(r, n, dtype, "ag"), gl, dst=root)
                if r == root:
                    for q in range(P):
                        c.eq(gl[q], everyone[q], f"gather {dtype} x{n} to {root} piece {q}")
                flat = torch.full((P * n,), -9, dtype=DTYPES[dtype]) if r == root else None
                g.gather(data(r, n, dtype, "ag"), flat, dst=root)
                if r == root:
                    c.eq(flat, torch.cat(everyone), f"gather flat {dtype} x{n} to {root}")
                t = torch.full((n,), -9, dtype=DTYPES[dtype])
                sl = [data(root, n, dtype, ("sc", q)) for q in range(P)] if r == root else None
                g.scatter(t, sl, src=root)
                c.eq(t, data(root, n, dtype, ("sc", r)), f"scatter list {dtype} x{n} from {root}")
                sl = [data(root, n, dtype, ("sc", q)) for q in range(P)]   # the root's output is scatter_list[root]
                t = sl[r] if r == root else torch.full((n,), -9, dtype=DTYPES[dtype])
                g.scatter(t, sl if r == root else None, src=root)
                c.eq(t, data(root, n, dtype, ("sc", r)), f"scatter list in place {dtype} x{n} from {root}")
                flat = torch.cat([data(root, n, dtype, ("sc", q)) for q in range(P)])
                t = flat[r * n:(r + 1) * n] if r == root else torch.full((n,), -9, dtype=DTYPES[dtype])
                g.scatter(t, flat if r == root else None, src=root)  # the root's output is its own piece
                c.eq(t, data(root, n, dtype, ("sc", r)), f"scatter flat {dtype} x{n} from {root}")


def check_reduce_scatter(g, c):
    P, r = g.world_size, g.rank
    for dtype in DTYPES:
        for n in LENGTHS:
            for op in ops_for(dtype):
                salt = ("rs", op)
                want = reference(P, P * n, dtype, salt, op)[r * n:(r + 1) * n]
                out = torch.full((n,), -9, dtype=DTYPES[dtype])
                g.reduce_scatter(out, data(r, P * n, dtype, salt), op=op)
                c.eq(out, want, f"reduce_scatter flat {dtype} x{n} {op}", dtype, op)
                out = torch.full((n,), -9, dtype=DTYPES[dtype])
                x = data(r, P * n, dtype, salt)
                g.reduce_scatter(out, [x[q * n:(q + 1) * n].clone() for q in range(P)], op=op)
                c.eq(out, want, f"reduce_scatter list {dtype} x{n} {op}", dtype, op)
                inp = data(r, P * n, dtype, salt)
                g.reduce_scatter(inp[r * n:(r + 1) * n], inp, op=op)  # output is a piece of the input
                c.eq(inp[r * n:(r + 1) * n], want, f"reduce_scatter in place {dtype} x{n} {op}", dtype, op)


def check_all_to_all(g, c):
    P, r = g.world_size, g.rank
    # piece a -> b has this many elements: uneven, some empty, the same total on every rank
    # (PARATRAIN_DEBUG's check compares the total, see group.py)
    size = lambda a, b: 3 * ((a + b) % P)
    for dtype in DTYPES:
        for n in LENGTHS:
            out = torch.full((P * n,), -9, dtype=DTYPES[dtype])
            g.all_to_all(out, data(r, P * n, dtype, "a2a"))
            want = torch.cat([data(q, P * n, dtype, "a2a")[r * n:(r + 1) * n] for q in range(P)])
            c.eq(out, want, f"all_to_all even {dtype} x{n}")
        for views in (False, True):  # separate tensors, or views of one (sent as one buffer)
            flat = torch.full((sum(size(q, r) for q in range(P)),), -9, dtype=DTYPES[dtype])
            out = list(flat.split([size(q, r) for q in range(P)])) if views else \
                [torch.full((size(q, r),), -9, dtype=DTYPES[dtype]) for q in range(P)]
            g.all_to_all(out, [data(r, size(r, q), dtype, ("a2av", q)) for q in range(P)])
            for q in range(P):
                c.eq(out[q], data(q, size(q, r), dtype, ("a2av", r)), f"all_to_all uneven {dtype} from {q}")


def check_p2p_and_barrier(g, c):
    import paratrain as pt
    P, r = g.world_size, g.rank
    right, left = (r + 1) % P, (r - 1) % P
    for dtype in DTYPES if P > 1 else ():   # a rank cannot send to itself
        for i, n in enumerate(LENGTHS + (200_001,)):  # the last one is past any eager limit
            w = g.isend(data(r, n, dtype, ("p2p", right)), right, tag=i)
            t = torch.full((n,), -9, dtype=DTYPES[dtype])
            assert g.recv(t, left, tag=i) == left
            w.wait()
            c.eq(t, data(left, n, dtype, ("p2p", r)), f"send/recv {dtype} x{n}")
    t = torch.zeros(4)
    if P > 1:
        rw = g.irecv(t, left, tag=7)
        g.isend(torch.full((4,), float(r)), right, tag=7).wait()
        rw.wait()
        c.eq(t, np.full(4, float(left)), "isend/irecv")
    # A message of the wrong size is an error, not silently short or truncated.
    for sent, room in ((3, 4), (5, 4), (100_000, 99_999)) if P > 1 else ():  # the last past Open MPI's eager limit
        w = g.isend(torch.zeros(sent), right, tag=8)
        with pytest.raises(pt.MismatchError):
            g.recv(torch.zeros(room), left, tag=8)
        w.wait()
    for _ in range(3):
        g.barrier()
    g.barrier(async_op=True).wait()
    c.count += 1


def check_groups(g, c):
    import paratrain as pt
    from paratrain.comm.mpi_backend import mpi_subgroup
    P, r = g.world_size, g.rank
    members = [P - 1, 0] if P > 1 else [0]
    sub = pt.new_group(members)
    assert (sub is None) == (r not in members), (r, sub)
    if sub is not None:
        t = data(r, 5, "float32", "sub")
        sub.all_reduce(t)
        c.eq(t, sum(f64(data(q, 5, "float32", "sub")) for q in members), "new_group all_reduce")
        assert sub.ranks == sorted(members) and sub.ranks[sub.rank] == r
    leaders = list(range(1, P)) or [0]
    lg = mpi_subgroup(leaders, r)
    assert (lg is None) == (r not in leaders)
    if lg is not None:
        t = torch.full((3,), float(r), dtype=torch.bfloat16)
        lg.all_reduce(t)
        c.eq(t, np.full(3, float(sum(leaders))), "mpi_subgroup all_reduce")
        lg.destroy()


def check_timeouts(g, c):
    """A rank left waiting raises CommTimeout naming the peer; the receive given up on
    leaves nothing posted behind, so the message that comes late goes to the next receive."""
    import paratrain as pt
    P, r = g.world_size, g.rank
    if P < 2:
        return
    t2 = pt.new_group(range(P))
    t2.timeout = 0.3
    t2._debug = False  # rank 0's abandoned barrier must be a plain Ibarrier the others can meet
    if r == 0:
        start = time.monotonic()
        with pytest.raises(pt.CommTimeout, match="recv from rank 1") as e:
            t2.recv(torch.zeros(3), 1, tag=5)
        assert e.value.ranks == (1,) and time.monotonic() - start < 5
    g.barrier()
    if r == 1:
        t2.send(torch.full((3,), 4.0), 0, tag=5)
    if r == 0:
        t = torch.zeros(3)
        t2.recv(t, 1, tag=5)
        c.eq(t, np.full(3, 4.0), "recv after a timed-out recv")
        with pytest.raises(pt.CommTimeout, match="barrier"):
            t2.barrier()  # the others are not there
    g.barrier()
    if r != 0:
        t2.timeout = 30
        t2.barrier()  # meets rank 0's abandoned barrier, which MPI still completes
    g.barrier()
    c.count += 1


def check_mismatch(g, c):
    """PARATRAIN_DEBUG=1: ranks calling with different shapes all fail loudly."""
    import paratrain as pt
    if os.environ.get("PARATRAIN_DEBUG") != "1" or g.world_size < 2:
        return
    with pytest.raises(pt.MismatchError, match="disagree"):
        g.all_reduce(torch.zeros(5 if g.rank == 0 else 6))
    c.count += 1


def worker():
    import paratrain as pt
    g = pt.init(backend="mpi")
    assert g.backend == "mpi" and pt.world() is g
    c = Checker(g.rank)
    start = time.monotonic()
    for check in (check_all_reduce, check_broadcast_reduce, check_gathers, check_reduce_scatter,
                  check_all_to_all, check_p2p_and_barrier, check_groups, check_mismatch, check_timeouts):
        t0 = time.monotonic()
        check(g, c)
        if os.environ.get("VERBOSE"):
            print(f"rank {g.rank}: {check.__name__} {time.monotonic() - t0:.2f}s", flush=True)
    print(f"rank {g.rank}/{g.world_size}: {c.count} checks passed in {time.monotonic() - start:.1f}s", flush=True)
    pt.destroy()


def phases(names):
    """PHASES' ``names`` one after another in this mpirun's ranks, each in the environment
    it asks for; "phase <name> ended" after each."""
    import runpy
    for name in names:
        script, env = PHASES[name]
        os.environ.update(env)
        if script is None:
            worker()
        else:
            sys.argv = [script, "mpi"]
            runpy.run_path(str(Path(__file__).parent / "workers" / script), run_name="__main__")
        print(f"phase {name} ended", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        phases(sys.argv[1].split(","))
    else:
        worker()
