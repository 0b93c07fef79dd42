"""Every collective, op and dtype against numpy, through real processes started
by the launcher, on each backend. Small shm slots and chunks force the
multi-round and multi-chunk paths with small data."""
import pytest

from conftest import cma_permitted, launch

SMALL_SLOTS = {"PARATRAIN_SHM_SLOT_BYTES": "65536", "PARATRAIN_SHM_CHUNK_BYTES": "16384"}
ALL_DTYPES = "float16,bfloat16,float32,float64,int32,int64,uint8"
# On the wider groups (4-5 ranks: recursive doubling's fold, odd sizes, sub-groups of 3), the
# dtypes whose reductions differ in kind: the two half-precision ones, float32, an integer.
# What a dtype does is the same at every width; every dtype runs on 1-3 ranks (and 4 over hosts).
WIDE_DTYPES = "float16,bfloat16,float32,int64"


def _ok(res, n, backend):
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    passed = [l for l in res.stdout.splitlines() if "collective checks passed on " + backend in l]
    assert len(passed) == n, out[-4000:]


@pytest.mark.alone   # a 3 s bound on the exit
@pytest.mark.timeout(90)
def test_debug_receive_left_pending_does_not_hold_the_exit(tmp_path):
    """PARATRAIN_DEBUG on torch: a script that ends with an irecv never matched
    (and no pt.destroy()) exits at once, as without debug, instead of Python's
    join of the receive's lane thread holding it until the peer goes or the
    timeout (work.program_ending)."""
    script = tmp_path / "ends_with_a_pending_irecv.py"
    script.write_text(
        "import atexit, time\n"
        "import numpy as np\n"
        "import paratrain as pt\n"
        "g = pt.init(backend='torch')\n"
        "if g.rank == 0:\n"
        "    g.irecv(np.zeros(4, np.float32), 1, tag=5)   # never sent\n"
        "    ended = time.monotonic()\n"
        "    atexit.register(lambda: print(f'exit held {time.monotonic() - ended:.1f}s', flush=True))\n"
        "else:\n"
        "    time.sleep(7)\n")
    res = launch(2, str(script), env={"PARATRAIN_DEBUG": "1", "PARATRAIN_TIMEOUT": "30"})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    held = [float(l.rsplit(" ", 1)[1].rstrip("s")) for l in res.stdout.splitlines() if "exit held" in l]
    assert len(held) == 1 and held[0] < 3, out[-3000:]   # not held until rank 1 leaves, 7 s in


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend,debug", [("shm", "0"), ("torch", "0"), ("hierarchical", "0"),
                                           ("shm", "1"), ("torch", "1"), ("hierarchical", "1")])
def test_point_to_point_matches_by_peer_and_tag(backend, debug, no_leftover_segments):
    """Receives from two peers complete in either order, tags pick their message,
    and a user's message left in a channel survives collectives that send their own
    (tests/workers/p2p_matching.py; over MPI in test_mpi_backend.py). With
    PARATRAIN_DEBUG=1 every message goes behind its envelope on torch and
    hierarchical (envelopes.py): the same checks pass, and a receive of the wrong
    size or dtype is refused there too instead of Gloo aborting the process."""
    env = dict(SMALL_SLOTS, PARATRAIN_DEBUG=debug,
               **({"PARATRAIN_PRETEND_HOSTS": "2"} if backend == "hierarchical" else {}))
    res = launch(3, "p2p_matching.py", backend, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert res.stdout.count("p2p matching checks passed on " + backend) == 3, out[-4000:]


@pytest.mark.timeout(90)
def test_irecvs_from_a_silent_peer_time_out_together():
    """Four pending irecvs from a live, silent peer all fail about one timeout after
    they were posted (tests/workers/silent_peer.py; over MPI in test_mpi_backend.py)."""
    res = launch(2, "silent_peer.py", "shm", env={"PARATRAIN_TIMEOUT": "2"})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "silent peer checks passed" in res.stdout, out[-4000:]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend,n", [("shm", 1), ("shm", 3), ("torch", 3), ("hierarchical", 3)])
def test_init_again_after_destroy(backend, n, no_leftover_segments):
    """pt.init() after pt.destroy(), three rounds, the old groups still referenced
    and the ranks out of step (tests/workers/reinit.py): each round's collectives
    right, nothing of the last round's rendezvous seen; over MPI in test_mpi_backend.py."""
    env = {"PARATRAIN_PRETEND_HOSTS": "2"} if backend == "hierarchical" else {}
    res = launch(n, "reinit.py", backend, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert res.stdout.count("re-init checks passed on " + backend) == n, out[-4000:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_shm_all_collectives(n, no_leftover_segments):
    algos = ",ring,tree,naive" if n in (2, 3) else ""
    dtypes = ALL_DTYPES if n <= 3 else WIDE_DTYPES
    res = launch(n, "collectives.py", "--backend", "shm", "--algorithms", algos, "--dtypes", dtypes,
                 "--subgroup", env=SMALL_SLOTS)
    _ok(res, n, "shm")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_numpy_arrays_default_slots(backend):
    """Every collective given numpy arrays (views of the tensors the checks read),
    every dtype numpy has, including the sizes that take the shm engine's large paths."""
    res = launch(2, "collectives.py", "--backend", backend, "--numpy",
                 "--dtypes", "float16,float32,float64,int32,int64,uint8", "--sizes", "0,3,300001")
    _ok(res, 2, backend)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n,cma", [(2, "1"), (3, "1"), (3, "0")])
def test_shm_all_gather_single_copy_from_private_memory(n, cma, no_leftover_segments):
    """Large all_gathers over private buffers read each peer's input with
    process_vm_readv (shm/cma.py), which this machine's kernel allows;
    PARATRAIN_CMA=0 keeps the two-copy path. Both against numpy, odd sizes (the
    sizes between, below cma.MIN_BYTES, are test_shm_all_collectives')."""
    if cma == "1" and not cma_permitted():
        pytest.skip("this kernel does not let a process read a sibling's memory (process_vm_readv)")
    res = launch(n, "collectives.py", "--backend", "shm", "--dtypes", "float32,float64,uint8",
                 "--sizes", "0,7,1048583", "--expect-single-copy", "yes" if cma == "1" else "no",
                 env={"PARATRAIN_CMA": cma})
    _ok(res, n, "shm")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 4, 5])
def test_algorithms_agree_on_long_messages_and_wide_groups(n, no_leftover_segments):
    """ring, tree and naive against numpy and each other, beside the default: on a
    message whose ring segments span several pipeline chunks (ring.PIPELINE_BYTES,
    1 MiB; the segments of the default sizes fit in one), and on 4 and 5 ranks,
    where recursive doubling takes more than one step and folds in the ranks
    beyond the largest power of two."""
    res = launch(n, "collectives.py", "--backend", "shm", "--algorithms", ",ring,tree,naive",
                 "--dtypes", "float32,int64", "--sizes", "0,7,1001",
                 "--big-all-reduce", str(n * (1 << 20) // 4 + 5 * (1 << 18) + 3))
    _ok(res, n, "shm")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,algo,n", [("shm", "ring", 3), ("shm", "tree", 2), ("shm", "naive", 3),
                                            ("shm", None, 2), ("torch", "tree", 2), ("torch", None, 3)])
def test_paratrain_algo_chooses_every_all_reduce_of_a_launched_job(backend, algo, n):
    """PARATRAIN_ALGO in the launcher's environment (as NCCL_ALGO is used) reaches
    every worker: each all_reduce that names no algorithm, small or large, runs the
    one it names and matches numpy. Empty (as unset), the backend's own algorithm runs."""
    env = {"PARATRAIN_ALGO": algo or ""}
    res = launch(n, "collectives.py", "--backend", backend, "--dtypes", "float32", "--sizes", "0",
                 "--expect-env-algorithm", algo or "native", env=env)
    _ok(res, n, backend)


@pytest.mark.timeout(120)
def test_an_unknown_paratrain_algo_stops_the_job_with_the_choices():
    res = launch(2, "collectives.py", "--backend", "shm", "--dtypes", "float32", "--sizes", "7",
                 env={"PARATRAIN_ALGO": "butterfly"})
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-4000:]
    assert "unknown algorithm 'butterfly'; choose from ['direct', 'naive', 'ring', 'tree']" in out, out[-4000:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_portable_collectives_over_point_to_point_only(n):
    """ProcessGroup's own collectives, which a backend gets from send and recv alone
    (no backend here needs them: each has native ones), on a group that borrows only
    those two from the shm engine: every collective, op and dtype against numpy,
    sizes on both sides of the default's tree/ring switch (64 KiB)."""
    res = launch(n, "collectives.py", "--backend", "shm", "--portable", "--dtypes", "float32,bfloat16,int64,uint8",
                 "--sizes", "0,7,1001,20011")
    _ok(res, n, "shm")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n,cma", [(2, "1"), (3, "1"), (2, "0")])
def test_shm_large_all_reduce_fetches_reduced_slices_from_private_memory(n, cma, no_leftover_segments):
    """From cma.MIN_ALL_REDUCE_BYTES (32 MiB) an all-reduce of private tensors fetches
    the reduced slices from their owners' buffers with process_vm_readv; with
    PARATRAIN_CMA=0 it stays on the direct path. 33 MiB of float32, odd length."""
    if cma == "1" and not cma_permitted():
        pytest.skip("this kernel does not let a process read a sibling's memory (process_vm_readv)")
    res = launch(n, "collectives.py", "--backend", "shm", "--dtypes", "float32", "--sizes", "0",
                 "--big-all-reduce", str((33 << 20) // 4 + 3), "--expect-single-copy", "yes" if cma == "1" else "no",
                 env={"PARATRAIN_CMA": cma})
    _ok(res, n, "shm")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [1, 2, 5])   # 5: odd, not a power of two, a 3-rank sub-group
def test_torch_gloo_backend(n):
    res = launch(n, "collectives.py", "--backend", "torch", "--algorithms", ",ring,tree",
                 "--dtypes", ALL_DTYPES if n <= 3 else WIDE_DTYPES, "--subgroup")
    _ok(res, n, "torch")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_backend_hands_the_callers_tensors_to_torch_distributed(n):
    """The torch backend passes torch tensors through, with no numpy round trip, so code
    written against pt runs over NCCL on GPUs unchanged: on the CPU, the very tensor
    object (or, for a 2-D one in a gathering collective, its memory) reaches the
    wrapped torch.distributed function, for every collective and point to point."""
    res = launch(n, "torch_passthrough.py")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("tensor pass-through checks passed") == n, res.stdout + res.stderr


EXITS_WITHOUT_DESTROY = """
import atexit, os
import torch
import torch.distributed as dist

def gloo_threads():  # the engine's native threads, by the names Gloo gives them
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return [n for n in names if "gloo" in n]

atexit.register(lambda: print("released at exit:", not dist.is_initialized(), "gloo threads left:",
                              gloo_threads(), flush=True))  # registered first, so it runs last
import paratrain as pt
g = pt.init(backend="torch")
x = torch.ones(1000)
g.all_reduce(x)
g.all_reduce(x, async_op=True).wait()
opt = torch.optim.SGD([torch.nn.Parameter(x.clone())], lr=0.1)  # imports torch._dynamo, after init
print("gloo threads while running:", len(gloo_threads()) > 0, flush=True)
print("sum", x[0].item(), flush=True)
"""


@pytest.mark.timeout(60)
def test_torch_backend_is_released_at_exit_without_destroy(tmp_path):
    """A script that returns without pt.destroy() still has torch.distributed's group
    released before the interpreter finalizes (world._destroy_at_exit): left alive,
    Gloo aborted the process at exit in 8 of 40 runs ("terminate called without an
    active exception"). Released means its threads are gone, not only that
    torch.distributed says it is uninitialized: an optimizer made after pt.init()
    imports torch.distributed.nn.functional, whose defaults kept the group alive
    (world.bind_world_defaults_early). Checked by a handler the script registered
    before pt.init, so atexit runs it after ours."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS_WITHOUT_DESTROY)
    res = launch(2, str(script))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert res.stdout.count("sum 4.0") == 2, res.stdout
    assert res.stdout.count("gloo threads while running: True") == 2, res.stdout
    assert res.stdout.count("released at exit: True gloo threads left: []") == 2, res.stdout


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [4, 5])
def test_hierarchical_pretend_hosts(n, no_leftover_segments):
    # With 4 ranks, PARATRAIN_ALGO names the backend's own algorithm, which the
    # host leaders' Gloo group must not try to run itself.
    env = dict(SMALL_SLOTS, PARATRAIN_PRETEND_HOSTS="2", **({"PARATRAIN_ALGO": "hierarchical"} if n == 4 else {}))
    res = launch(n, "collectives.py", "--algorithms", ",ring", "--dtypes", ALL_DTYPES if n == 4 else WIDE_DTYPES,
                 "--sizes", "0,7,1000,100003", "--subgroup", env=env)
    _ok(res, n, "hierarchical")
    assert res.stdout.count("host leaders talk over torch") == 2, res.stdout[-4000:]   # Gloo, the default


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n,backend", [(2, "shm"), (3, "shm"), (2, "torch")])
def test_shared_buffers_all_reduce(n, backend, no_leftover_segments):
    res = launch(n, "shared_buffers.py", env={"PARATRAIN_BACKEND": backend})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert res.stdout.count("shared-buffer checks passed on " + backend) == n, out[-4000:]
