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


def launch(n, script, *args, env=None, timeout=150, launcher_args=()):
    """Run a worker script under `python -m paratrain.run -n N`; returns CompletedProcess (text)."""
    e = dict(os.environ)
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


def once_per_run(tmp_path_factory, name, make):
    """``make()``'s result (JSON), made by one process of the run. Under ``pytest -n 2`` a
    module's tests are shared out between the two workers, and each sets the module's
    fixtures up anew (xdist's grouping marks do not reach pytest 9's node ids): a fixture
    that trains a dozen jobs would train them twice. The first worker to ask makes it,
    holding a lock in the run's folder; the other waits, then reads what it wrote."""
    import fcntl
    import json
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make()
    shared = tmp_path_factory.getbasetemp().parent   # the run's folder, above each worker's own
    record = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if record.exists():
            return json.loads(record.read_text())
        made = make()
        record.write_text(json.dumps(made))
        return made


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
    procs = []
    for r in range(n):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PARATRAIN_TIMEOUT="30")
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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)
        if item.module.__name__ in ALONE_MODULES:
            item.add_marker(pytest.mark.alone)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked ``alone`` holds the suite's lock exclusively, the
    others shared: it waits for the running test of the other worker to end, and no other
    starts until it has ended. A turnstile taken first keeps a stream of shared holders
    from starving it. Outside this hook's wait, pytest-timeout's clock runs: a test is not
    timed while it waits for its turn."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    import fcntl
    base = os.path.join(tempfile.gettempdir(), f"paratrain-pytest-{run}")
    with open(base + ".turnstile", "a") as turnstile, open(base + ".lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_collection_finish(session):
    session.launches = any(item.get_closest_marker("quick") is None for item in session.items)
