import os
import subprocess
import sys
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


def spawn(n, script, *args, env=None, port=None):
    """Start n ranks directly (no launcher), e.g. to see how a survivor behaves alone."""
    from paratrain.launch.local import free_port
    port = port or free_port()
    procs = []
    for r in range(n):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PARATRAIN_TIMEOUT="30")
        e.update(env or {})
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / script), *args], cwd=ROOT, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


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
    before = set(our_segments())
    yield
    assert set(our_segments()) - before == set(), "shared-memory segments left behind in /dev/shm"


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
QUICK_MODULES = {"test_algorithms", "test_config", "test_ps_logic", "test_ps_sparse", "test_ps_wire",
                 "test_readme", "test_ssp_simulation", "test_strategies", "test_tasks", "test_units",
                 "test_wire"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)
