import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"


_flights = None   # this pytest worker's folder for the flight recorders of the jobs its tests start

# paratrain train's front-end starts no fork server of its own (launch/warm.py): the suite's
# serves its launches, and a front-end called in this process must not start one per test
os.environ.setdefault("PARATRAIN_WARM_START", "0")


@pytest.fixture(scope="session", autouse=True)
def flight_folder(tmp_path_factory):
    global _flights
    _flights = tmp_path_factory.mktemp("flight")


def flight_env():
    """PARATRAIN_FLIGHT_DIR for one job a test starts: a folder of its own under the run's
    pytest folder (pytest keeps the last few runs'), not one in /tmp per job that stays."""
    return {"PARATRAIN_FLIGHT_DIR": tempfile.mkdtemp(prefix="job-", dir=_flights)} if _flights else {}


def launch(n, script, *args, env=None, timeout=150, launcher_args=()):
    """Run a worker script under `python -m paratrain.run -n N`; returns CompletedProcess (text)."""
    e = dict(os.environ, **flight_env())
    e.setdefault("PARATRAIN_TIMEOUT", "30")
    e.update(env or {})
    cmd = [sys.executable, "-m", "paratrain.run", "-n", str(n), *launcher_args, str(WORKERS / script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def python_m(args, env, cwd=ROOT, timeout=150):
    """``python -m ARGS`` (a CompletedProcess, text), forked from the suite's fork server
    when there is one: a front-end such as ``paratrain train`` then starts with torch
    already imported, as its workers do."""
    from paratrain.launch import forkserver
    return forkserver.run([sys.executable, "-m", *args], env, cwd=cwd, timeout=timeout)


# What the suite's workers and front-ends import: torch, the optimizer's torch._dynamo,
# the run's plot, the digits (scikit-learn, which sets KMP_* variables as it is imported:
# preloaded, a front-end's workers still fork), and the Hugging Face models of the hf-* tests.
SUITE_PRELOAD = ",".join(["torch", "torch._dynamo", "matplotlib.figure", "matplotlib.backends.backend_agg",
                          "sklearn.datasets",
                          "transformers", *(f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "bert", "llama"))])


def start_fork_server(address, preload=SUITE_PRELOAD, env=None, stderr=None):
    """A fork server listening at address (paratrain/launch/forkserver.py) that serves
    launches from this process's environment; it dies with this process."""
    from paratrain.launch import forkserver
    return forkserver.start_server(address, preload, None if env is None else dict(os.environ, **env), stderr=stderr)


@pytest.fixture(scope="session", autouse=True)
def fork_server(request):
    """Every worker the suite's launches start is a fork of one process that imported
    torch once (the launcher falls back to a fresh interpreter where that would not be the
    same). Not for a run of in-process tests only (`pytest -m quick`), which launches nothing."""
    if os.environ.get("PARATRAIN_FORKSERVER") is not None or not request.session.launches:
        yield None
        return
    from paratrain.launch.forkserver import private_address
    address = private_address()
    log = os.path.join(os.path.dirname(address), "server.log")
    with open(log, "w") as stderr:
        proc = start_fork_server(address, stderr=stderr)
    os.environ["PARATRAIN_FORKSERVER"] = address
    try:
        yield address
    finally:
        del os.environ["PARATRAIN_FORKSERVER"]
        proc.kill()   # the interpreter's exit with torch loaded takes a second; the directory goes below
        proc.wait(timeout=30)
        with open(log) as f:
            FRESH_STARTS.extend(line.split(": ", 2)[-1].strip() for line in f if "started one fresh" in line)
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)


FRESH_STARTS = []   # why the suite's server started a worker fresh, one entry a worker


def pytest_terminal_summary(terminalreporter):
    """How many workers started fresh instead of forked, and why: a launch that
    should fork and does not makes the suite slower, not red."""
    if FRESH_STARTS:
        import collections
        terminalreporter.write_line(f"fork server: {len(FRESH_STARTS)} workers started fresh:")
        for why, n in collections.Counter(FRESH_STARTS).most_common(8):
            terminalreporter.write_line(f"  {n} x {why[:160]}")


def spawn(n, script, *args, env=None, port=None):
    """Start n ranks directly (no launcher), e.g. to see how a survivor behaves alone:
    forked from the suite's fork server when there is one (as python_m), else fresh."""
    from paratrain.launch import binding, forkserver
    from paratrain.launch.local import free_port
    port = port or free_port()
    address = os.environ.get("PARATRAIN_FORKSERVER")
    procs, flight = [], flight_env()   # one folder for the job's ranks
    for r in range(n):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PARATRAIN_TIMEOUT="30", **flight)
        e.update(env or {})
        cmd = [sys.executable, str(WORKERS / script), *args]
        if address:
            out = tempfile.TemporaryFile()
            with open(os.devnull) as null:
                proc = forkserver.start(address, cmd, dict(e, **binding.interpreter_env(1)), cwd=ROOT,
                                        stdin=null.fileno(), stdout=out.fileno(), stderr=out.fileno())
            if not isinstance(proc, str):
                procs.append(ForkedRank(proc, out))
                continue
            out.close()
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


class ForkedRank:
    """A rank spawn() forked from the server, with what the tests use of a Popen
    (pid, returncode, poll, wait, kill, communicate); its output went to a file."""

    def __init__(self, proc, out):
        self._proc, self._out = proc, out
        self.pid = proc.pid

    @property
    def returncode(self):
        return self._proc.returncode

    def poll(self):
        return self._proc.poll()

    def wait(self, timeout=None):
        return self._proc.wait(timeout)

    def kill(self):
        try:
            os.killpg(self.pid, 9)   # a fork has its own session
        except ProcessLookupError:
            pass

    def communicate(self, timeout=None):
        self._proc.wait(timeout)
        self._out.seek(0)
        text = self._out.read().decode(errors="replace")
        self._out.close()
        return text, None


def outputs(procs, timeout):
    """The output of each process from spawn(); any still running after ``timeout``
    seconds in all is killed, so a failing test leaves no worker behind."""
    deadline = time.monotonic() + timeout
    try:
        return [p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def our_segments():
    from paratrain.comm.shm.segment import leftover_segments
    return leftover_segments()


@pytest.fixture
def no_leftover_segments():
    """No segment this test's job made is left: one that shows up and stays. A job of the
    other worker's test (pytest -n 2) has its segments for a moment (they are unlinked once
    every rank maps them), so a new one must outlast a few seconds to count."""
    before = set(our_segments())
    yield
    deadline = time.monotonic() + 5
    while (left := set(our_segments()) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == set(), f"shared-memory segments left behind in /dev/shm: {sorted(left)}"


def child_with_buffer():
    """A child process holding the int64 array 0, 7, 14, 21, 28: (process, its address,
    the values). The caller ends it with ``process.communicate("")``."""
    import numpy as np
    code = ("import numpy as np, sys; a = np.arange(5, dtype=np.int64) * 7; "
            "print(a.__array_interface__['data'][0], flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, int(p.stdout.readline()), np.arange(5, dtype=np.int64) * 7


def cma_permitted():
    """Does this kernel let a process read a sibling's memory (process_vm_readv)?
    Containers with a strict seccomp profile or Yama ptrace_scope >= 1 do not."""
    import numpy as np
    from paratrain.comm.shm import cma
    p, addr, want = child_with_buffer()
    try:
        got = np.zeros(5, dtype=np.int64)
        cma.read(p.pid, got, addr)
        return got.tolist() == want.tolist()
    except OSError:
        return False
    finally:
        p.communicate("")


def passed_on_every_rank(res, what, n):
    """A launch() ended well: exit 0 and "<what> passed on rank" printed by each of its n ranks."""
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert out.count(f"{what} passed on rank") == n, out[-4000:]


# In-process tests of the logic (no worker processes): `pytest -m quick` for the inner loop.
# A test elsewhere joins with @pytest.mark.quick.
QUICK_MODULES = {"test_algorithms", "test_config", "test_elastic_sampler", "test_ps_logic", "test_ps_sparse",
                 "test_ps_wire", "test_readme", "test_simulate_costs", "test_simulate_step",
                 "test_simulate_strategies", "test_plan", "test_ssp_simulation",
                 "test_strategies", "test_tasks", "test_trace_logic", "test_units", "test_wire"}


# Tests that run while no other test does when the suite runs two at a time (pytest -n 2):
# their checks bound a time (a stall logged within 3 s, a straggler's measured factor),
# or their ranks spin on the cores while they wait (Open MPI's progress loop).
ALONE_MODULES = {"test_mpi_backend", "test_stall"}


# Modules whose tests share one costly module fixture (a dozen training jobs, one mpirun of
# five phases): under pytest -n 2 all their tests go to one worker, which sets it up once.
TOGETHER_MODULES = {"test_train_elastic", "test_examples", "test_mpi_backend"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)
        if item.module.__name__ in ALONE_MODULES:
            item.add_marker(pytest.mark.alone)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_turn)   # the order the scheduler below hands the tests out in


def _turn(item):
    """When a test's turn comes under pytest -n 2: the modules run together first (the
    longest units of work), then the tests that launch processes, then the in-process ones,
    which fill the cores while the last launches end, then those that run alone, which
    then wait for no long test of the other worker."""
    if item.get_closest_marker("alone"):
        return 3
    if item.get_closest_marker("quick"):
        return 2
    return 0 if item.module.__name__ in TOGETHER_MODULES else 1


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest -n 2 hands out one unit of work at a time, in the order above (xdist's
    load-scope scheduling, whose units are single tests here but for TOGETHER_MODULES'
    modules). xdist's default hands a quarter of the tests out at the start, and a test
    marked alone then waits for whatever long test the other worker was given."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TestsOrModules(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if Path(module).stem in TOGETHER_MODULES else nodeid
    return TestsOrModules(config, log)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked ``alone`` holds the suite's lock exclusively, the
    others shared: it waits for the running test of the other worker to end, and no other
    starts until it has ended. A turnstile taken first keeps a stream of shared holders
    from starving it. Outside this hook's wait, pytest-timeout's clock runs: a test is not
    timed while it waits for its turn."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import fcntl
    shared = Path(item.config.option.basetemp).parent   # the run's folder; xdist gives each worker one below
    with open(shared / "alone.turnstile", "a") as turnstile, open(shared / "alone.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_collection_finish(session):
    session.launches = any(item.get_closest_marker("quick") is None for item in session.items)
