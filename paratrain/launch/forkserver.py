"""Start workers as forks of a process that has already imported torch.

    python -m paratrain.launch.forkserver /tmp/pt.sock &      # imports torch once, then waits
    PARATRAIN_FORKSERVER=/tmp/pt.sock paratrain run -n 4 train.py

Why: a worker spends seconds of CPU importing torch (and torch._dynamo, which
the first optimizer pulls in) before its script's first line, and N workers
started together on fewer than N cores pay it one after another. A server that
has imported them once forks each worker in milliseconds, copy-on-write, as
Android's zygote and ``multiprocessing``'s forkserver do. The worker then runs
its script through the bootstrap (bootstrap.py) exactly as a fresh
``python -m paratrain.launch.bootstrap`` would: its own environment, working
directory, standard streams, session and CPU set.

A fork is only the same as a fresh interpreter when everything read as an
interpreter or a library starts is the same, so the server serves a request
only when those variables (``STARTUP_PREFIXES``: PYTHON*, LD_*, OMP_*, torch's,
...), the interpreter and the kernel namespaces (a ``--link`` job's private
network) match its own, and refuses it otherwise; the launcher then starts that
worker fresh, as it does when no server is set or the server is gone. One thing
differs and cannot be made the same: forks share the server's string-hash seed,
where fresh interpreters each draw one.

The wire: one Unix ``SOCK_SEQPACKET`` connection per worker. The launcher sends
one JSON message (the bootstrap's arguments, environment, directory, CPUs)
with the worker's stdin, stdout and stderr attached (SCM_RIGHTS); the server
answers ``{"pid": N}`` (or ``{"refused": why}``), and ``{"returncode": rc}``
when the worker ends (negative: killed by that signal, as ``subprocess``).
If the launcher's end closes first, the launcher is gone: the server kills the
worker's process group, as PR_SET_PDEATHSIG does for a worker the launcher
forked itself. The socket lives in a directory only its owner can enter, and
nothing is unpickled.
"""
import argparse
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

from . import binding
from .parent import set_parent_death_signal, tie_to_parent

BOOTSTRAP = "paratrain.launch.bootstrap"
MODULE = "paratrain.launch.forkserver"
DEFAULT_PRELOAD = ("torch", "torch._dynamo")
# what a training run's workers import beyond those: its plot (paratrain compare's and plan's
# servers preload it, and simulate/footprint.py imports it before it measures a heap)
TRAINING_PRELOAD = (*DEFAULT_PRELOAD, "matplotlib.figure", "matplotlib.backends.backend_agg")
STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "GOTO", "KMP_", "GOMP_", "MALLOC_", "TORCH",
                    "PYTORCH_", "CUDA_", "HF_", "TRANSFORMERS_", "MPL")
NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user")
MAX_MESSAGE = 1 << 20   # a request: an environment is a few KiB


def startup_env(env):
    """The variables an interpreter or a preloaded library reads as it starts."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


def namespaces():
    ids = {}
    for ns in NAMESPACES:
        try:
            ids[ns] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            ids[ns] = None
    return ids


def interpreter():
    """The Python installation (a venv's python and python3 are the same one)."""
    return [os.path.realpath(sys.executable), sys.prefix, sys.version]


def mismatch(request, server_env, server_namespaces, set_by_preload):
    """Why this server cannot start the request's worker as a fresh interpreter
    would, or None. A variable the preload itself set (set_by_preload) may be
    missing from the request, or equal: a launcher forked from this server has it."""
    if request.get("interpreter") != interpreter():
        return f"the launcher runs another Python ({request.get('interpreter')}) than the server ({interpreter()})"
    if request.get("namespaces") != server_namespaces:
        return "the launcher is in other kernel namespaces (a private network, e.g. --link)"
    want, have = startup_env(request["env"]), startup_env(server_env)
    differ = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k)
                    and not (k in set_by_preload and want.get(k) == set_by_preload[k]))
    if differ:
        return f"start-up variables differ from the server's: {', '.join(differ[:5])}"
    return None


# --- the launcher's side -------------------------------------------------------------------------

class ForkedProcess:
    """A worker the fork server started: what the launcher uses of ``subprocess.Popen``
    (pid, poll, wait, returncode, stdout, stderr). Its exit status comes over the
    connection, since the server, not the launcher, is its parent."""

    def __init__(self, conn, pid, stdout, stderr):
        self._conn = conn
        self.pid = pid
        self.returncode = None
        self.stdout = stdout
        self.stderr = stderr

    def _read_status(self, timeout):
        if self.returncode is not None:
            return
        if not select.select([self._conn], [], [], timeout)[0]:
            return
        data = self._conn.recv(MAX_MESSAGE)
        # Nothing (the server died) means the worker died with it: PDEATHSIG is SIGKILL.
        self.returncode = json.loads(data)["returncode"] if data else -signal.SIGKILL
        self._conn.close()

    def poll(self):
        self._read_status(0)
        return self.returncode

    def wait(self, timeout=None):
        self._read_status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode


def bootstrap_argv(cmd):
    """The bootstrap's arguments for a ``python ...`` command line, or None when it
    is not one the bootstrap runs as python would (interpreter options, -c)."""
    cmd = list(cmd)
    if len(cmd) < 2 or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
        return None
    if cmd[1:3] == ["-m", BOOTSTRAP]:
        return cmd[3:]
    if cmd[1] == "-m" and len(cmd) > 2 or not cmd[1].startswith("-"):
        return cmd[1:]
    return None


def start(address, cmd, env, cwd=None, cpus=None, stdin=None, stdout=None, stderr=None):
    """Ask the server at address to start ``cmd`` (``python SCRIPT ARGS`` or ``python -m
    MODULE ARGS``, run through the bootstrap) with these file descriptors as its
    standard streams. Returns a ForkedProcess, or a string saying why not (the
    caller starts it fresh)."""
    argv = bootstrap_argv(cmd)
    if argv is None:
        return f"{' '.join(cmd[:2])} is not `python SCRIPT` or `python -m MODULE`"
    request = {"argv": argv, "env": dict(env), "cwd": os.fspath(cwd or os.getcwd()), "interpreter": interpreter(),
               "cpus": sorted(cpus) if cpus is not None else None, "namespaces": namespaces()}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(address)
        socket.send_fds(conn, [json.dumps(request).encode()], [stdin, stdout, stderr])
        reply = json.loads(conn.recv(MAX_MESSAGE) or b'{"refused": "the server closed the connection"}')
    except (OSError, ValueError) as e:
        conn.close()
        return f"no fork server at {address} ({e})"
    if "pid" not in reply:
        conn.close()
        return reply.get("refused", "the server refused")
    return ForkedProcess(conn, reply["pid"], None, None)


def run(cmd, env=None, cwd=None, timeout=None):
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a ``python`` command,
    forked from the server PARATRAIN_FORKSERVER names when there is one (the command then
    starts with the server's imports done: what benchmarks and tests that start many
    front-ends want), else fresh. Output goes through files, so nothing blocks; past
    ``timeout`` the forked process's group is killed and TimeoutExpired raised."""
    from .. import config
    env = dict(os.environ if env is None else env)
    address = config.get("PARATRAIN_FORKSERVER")
    if address:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull) as null:
            proc = start(address, cmd, dict(env, **binding.interpreter_env(1)), cwd=cwd,   # as the server started
                         stdin=null.fileno(), stdout=out.fileno(), stderr=err.fileno())
            if not isinstance(proc, str):
                try:
                    rc = proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)   # its workers die as their launcher's connections close
                    proc.wait(10)
                    raise
                out.seek(0)
                err.seek(0)
                return subprocess.CompletedProcess(cmd, rc, out.read().decode(errors="replace"),
                                                   err.read().decode(errors="replace"))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# --- the server's side ---------------------------------------------------------------------------

class Server:
    """Accepts requests, forks workers, reports how each ended. One thread: a
    select over the listening socket, the connections and the SIGCHLD pipe,
    then a reap of ended children."""

    def __init__(self, address, env_before_preload):
        self.pid = os.getpid()
        self.env = env_before_preload
        # What the preloaded libraries put in the environment as they were imported
        # (torch's inductor cache directory): a fresh worker's own imports would set it too.
        self.set_by_preload = {k: v for k, v in os.environ.items() if k not in env_before_preload}
        self.namespaces = namespaces()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(address)
        self.listener.listen(64)
        self.waiting = set()      # connections whose request has not come yet
        self.workers = {}         # pid -> its launcher's connection

    def serve_forever(self):
        """Sleep until a request, a launcher's end or a worker's end (SIGCHLD wakes
        the select through a pipe), never on a timer: an idle server costs nothing."""
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        while True:
            self.serve_once(None)

    def serve_once(self, timeout):
        launchers = [c for c in self.workers.values() if c is not None]
        ready = select.select([self.listener, self.wake_r, *self.waiting, *launchers], [], [], timeout)[0]
        for s in ready:
            if s == self.wake_r:
                while True:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        break
            elif s is self.listener:
                conn, _ = self.listener.accept()
                self.waiting.add(conn)
            elif s in self.waiting:
                self.waiting.discard(s)
                if _same_user(s):
                    self._answer(s)
                else:
                    s.close()
            else:
                self._launcher_gone(s)
        self._reap()

    def _answer(self, conn):
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        except OSError:
            conn.close()
            return
        try:
            request = json.loads(data) if data else None
            why = "an empty or malformed request" if not isinstance(request, dict) or len(fds) != 3 else \
                mismatch(request, self.env, self.namespaces, self.set_by_preload)
        except (ValueError, KeyError, TypeError) as e:
            why = f"a malformed request ({e})"
        if why is None:
            try:
                pid = os.fork()
            except OSError as e:
                why = f"fork failed: {e}"
            else:
                if pid == 0:
                    self._become_worker(request, fds)   # never returns
                self.workers[pid] = conn
        for fd in fds:
            os.close(fd)
        self._reply(conn, {"pid": pid} if why is None else {"refused": why})
        if why is not None:
            print(f"paratrain fork server: started one fresh: {why}", file=sys.stderr, flush=True)
            conn.close()

    def _reply(self, conn, message):
        try:
            conn.send(json.dumps(message).encode())
        except OSError:
            pass   # the launcher is gone; _launcher_gone or _reap deals with its worker

    def _launcher_gone(self, conn):
        """A connection with a live worker became readable: its launcher closed it
        (or sent what it must not); the worker must not outlive its launcher."""
        for pid, c in list(self.workers.items()):
            if c is conn:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                self.workers[pid] = None   # reaped by _reap, reported to nobody
        conn.close()

    def _reap(self):
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            if conn is not None:
                self._reply(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                conn.close()

    def _become_worker(self, request, fds):
        """In the child: drop the server's sockets, take the worker's streams,
        session, directory, environment and CPUs, and run the bootstrap."""
        status = 1
        try:
            self.listener.close()
            for c in [*self.waiting, *self.workers.values()]:
                if c is not None:
                    c.close()
            signal.set_wakeup_fd(-1)   # a fresh interpreter's signal state, not the server's
            for sig in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            os.close(self.wake_r)
            os.close(self.wake_w)
            os.setsid()
            set_parent_death_signal(self.pid)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(self.set_by_preload)
            os.environ.update(request["env"])
            binding.pin(None if request["cpus"] is None else set(request["cpus"]))
            if not sys.flags.safe_path:
                sys.path[0] = os.getcwd()   # as `python -m` puts it there; the bootstrap moves a script's
            gc.enable()
            _fresh_random_state()
            tempfile.tempdir = None   # read from the worker's own TMPDIR at first use, as a fresh interpreter does
            from . import bootstrap
            bootstrap.FORKED_FROM = self.pid   # (what a worker may say of how it started)
            status = bootstrap.main(request["argv"])
            bootstrap.finish(status)
        except BaseException:  # noqa: BLE001 - a worker that could not start says why and ends
            import traceback
            traceback.print_exc()
        os._exit(status or 1)


def _same_user(conn):
    """Only the server's own user (or root) may have workers started."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid in (os.getuid(), 0)


def _fresh_random_state():
    """What a fresh interpreter draws anew: numpy's global generator (Python's
    ``random`` reseeds itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m paratrain.launch.forkserver",
                                description="Import torch once and start paratrain's workers as forks of this "
                                            "process (set PARATRAIN_FORKSERVER to the socket for `paratrain run`).")
    p.add_argument("socket", help="the Unix socket to listen on (its directory should be private)")
    p.add_argument("--preload", default=",".join(DEFAULT_PRELOAD),
                   help=f"modules to import before serving (default {','.join(DEFAULT_PRELOAD)})")
    p.add_argument("--threads", type=int, default=1,
                   help="compute threads per worker, as `paratrain run --threads` (default 1)")
    args = p.parse_args(argv)
    launched = binding.interpreter_env(args.threads)
    if any(os.environ.get(k) != v for k, v in launched.items()):
        # What `paratrain run` gives its workers, read as the interpreter and torch start: start again with it.
        os.execve(sys.executable, [sys.executable, "-m", MODULE, *(sys.argv[1:] if argv is None else argv)],
                  {**os.environ, **launched})
    env = dict(os.environ)
    gc.disable()   # no collection leaves holes in the pages the workers will share
    for name in filter(None, args.preload.split(",")):
        importlib.import_module(name)
    gc.freeze()    # the workers' collections skip what was preloaded, so they neither scan nor copy its pages
    server = Server(args.socket, env)
    try:
        print(f"paratrain fork server: listening on {args.socket} (preloaded {args.preload})", flush=True)
        server.serve_forever()
    finally:
        try:
            os.unlink(args.socket)
        except OSError:
            pass


def spawn_server(address, preload=",".join(DEFAULT_PRELOAD), env=None, threads=1, stderr=None):
    """Start a fork server at address as a child of this process (it dies with it), without
    waiting for it; returns its Popen, whose stdout says when it listens (``listening``).
    env: its environment (default ours, without PARATRAIN_FORKSERVER and a launcher's
    PARATRAIN_ELASTIC); threads: its workers' compute threads; stderr: where it says
    what it refused."""
    e = {k: v for k, v in (os.environ if env is None else env).items()
         if k not in ("PARATRAIN_FORKSERVER", "PARATRAIN_ELASTIC")}
    return subprocess.Popen([sys.executable, "-m", MODULE, address, "--preload", preload, "--threads", str(threads)],
                            env=e, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            preexec_fn=tie_to_parent(os.getpid()))


def listening(proc, timeout):
    """Whether the fork server ``proc`` (spawn_server's) says it listens within ``timeout``
    seconds: its stdout read until it does, ends, or the time is up."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
        line = proc.stdout.readline()
        if not line:
            return False
        if "listening" in line:
            return True
    return False


def start_server(address, preload=",".join(DEFAULT_PRELOAD), env=None, timeout=60.0, stderr=None):
    """spawn_server, then wait until it listens; returns its Popen."""
    proc = spawn_server(address, preload, env, stderr=stderr)
    if not listening(proc, timeout):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the fork server at {address} did not start within {timeout:g}s")
    return proc


SUN_PATH_MAX = 107   # bytes of a Unix socket's path, its terminating NUL left out (Linux's sun_path is 108)


def private_address():
    """A socket path in a new directory only this user can enter: under the temporary
    directory (TMPDIR), or under /tmp where that is too deep for a socket's path."""
    directory = tempfile.mkdtemp(prefix="paratrain-fork-")
    if len(os.fsencode(os.path.join(directory, "server.sock"))) > SUN_PATH_MAX:
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix="paratrain-fork-", dir="/tmp")
    return os.path.join(directory, "server.sock")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # unlink the socket on a polite stop
    main()
