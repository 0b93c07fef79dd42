"""One worker process, as the launcher sees it.

Each worker is started in its own session (so a Ctrl-C at the terminal reaches
only the launcher, which then stops the workers in order, and so a signal to
the worker's process group also reaches anything the worker started), and is
tied to the launcher's life with ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: if the
launcher dies abruptly (kill -9, OOM), the kernel kills the worker too, and no
orphan is left holding a port, a GPU or shared memory.

Its stdout and stderr come back through pipes; two reader threads copy them to
the launcher's own stdout and stderr line by line with a ``[rank R] `` prefix,
and keep the last lines so the failure report can show how a worker died.
An optional ``on_line`` hook sees every line first and may consume it (how the
front-end of ``paratrain train`` turns rank 0's progress lines into a bar).
"""
import collections
import os
import subprocess
import sys
import threading
import time

from .. import config
from .parent import tie_to_parent

TAIL_LINES = 20

# One lock for everything the launcher writes, so lines from different ranks
# never interleave mid-line.
OUTPUT_LOCK = threading.Lock()


def emit(stream_name, data):
    """Write bytes to the launcher's current sys.stdout / sys.stderr and flush.

    Bytes go to the underlying buffer when there is one, so whatever a worker
    prints (any encoding) arrives unchanged. A closed launcher stream (e.g.
    output piped into ``head``) is ignored: the readers must keep draining the
    pipes or the workers would block on a full pipe."""
    stream = getattr(sys, stream_name)
    try:
        buf = getattr(stream, "buffer", None)
        if buf is not None:
            stream.flush()
            buf.write(data)
            buf.flush()
        else:
            stream.write(data.decode(errors="replace"))
            stream.flush()
    except (OSError, ValueError):
        pass


class Worker:
    """A worker: its ranks, its process, its output readers and its last lines."""

    def __init__(self, rank, local_rank, cmd, env, prefix=True, on_line=None, label=None, cpus=None):
        self.rank = rank
        self.label = label or f"rank {rank}"  # "server 0" for a parameter server
        self.local_rank = local_rank
        self.cmd = cmd
        self.env = env
        self.prefix = f"[{self.label}] ".encode() if prefix else b""
        self.tail = collections.deque(maxlen=TAIL_LINES)  # stdout and stderr, in arrival order
        self.cpus = cpus  # the CPUs it is pinned to (binding.py), None for anywhere
        self.proc = None
        self.fresh_because = None  # why the fork server (PARATRAIN_FORKSERVER) did not start it, if it was asked
        self.signalled = False  # the launcher sent it a signal (its exit is then not a failure of its own)
        self.note = ""  # said after how it ended in the failure report ("after 3 restarts")
        self._readers = []
        # on_line(worker, stream_name, text) -> True if it took the line (text: no newline).
        self.on_line = on_line
        self.forkserver = None  # a fork server of its own to start from (else PARATRAIN_FORKSERVER's, if set)

    @property
    def pid(self):
        return self.proc.pid

    def start(self):
        """Spawn the process: a fork of the fork server when one is set and can
        start it as a fresh interpreter would (forkserver.py), else a fresh one.
        Output readers are started separately (start_output), after every worker
        is spawned, so no thread is running while we fork."""
        address = self.forkserver or config.get("PARATRAIN_FORKSERVER")
        self.proc = self._start_forked(address) if address else None
        if self.proc is None:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=tie_to_parent(os.getpid(), self.cpus))

    def _start_forked(self, address):
        """A ForkedProcess with its output pipes, or None (and why, in fresh_because) if the
        server cannot start it."""
        from . import forkserver
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            proc = forkserver.start(address, self.cmd, self.env, cpus=self.cpus, stdin=devnull, stdout=out_w,
                                    stderr=err_w)
        finally:
            for fd in (devnull, out_w, err_w):
                os.close(fd)
        if isinstance(proc, str):
            os.close(out_r)
            os.close(err_r)
            self.fresh_because = proc
            return None
        proc.stdout, proc.stderr = os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")
        return proc

    def start_output(self):
        for pipe, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
            t = threading.Thread(target=self._pump, args=(pipe, name), daemon=True,
                                 name=f"paratrain-rank{self.rank}-{name}")
            t.start()
            self._readers.append(t)

    def _pump(self, pipe, stream_name):
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"  # the last line of a worker that did not end it
                text = line[:-1].decode(errors="replace").rstrip("\r")
                with OUTPUT_LOCK:
                    if self._offer(stream_name, text):
                        continue  # consumed: neither printed nor kept in the tail
                    self.tail.append(text)
                    emit(stream_name, self.prefix + line)
        finally:
            pipe.close()

    def _offer(self, stream_name, text):
        """Show the line to on_line; True if it took it.

        Called holding OUTPUT_LOCK, so whatever the hook writes cannot interleave
        with other ranks' lines (and the hook must not take that lock itself). A
        hook that raises is dropped with one message, and its lines pass through:
        this reader must keep draining the pipe, or the worker blocks on it."""
        if self.on_line is None:
            return False
        try:
            return bool(self.on_line(self, stream_name, text))
        except Exception as e:  # noqa: BLE001 - any bug in the hook, reported below
            self.on_line = None
            emit("stderr", f"paratrain run: output hook failed on rank {self.rank}'s output "
                           f"({type(e).__name__}: {e}); showing its lines unchanged\n".encode())
            return False

    def join_output(self, deadline):
        """Wait for the readers to reach end-of-file, until ``deadline`` (time.monotonic()).
        A grandchild that inherited the pipe can hold it open forever, hence the bound,
        one for both readers (each had the whole of it)."""
        for t in self._readers:
            t.join(max(0.0, deadline - time.monotonic()))

    def poll(self):
        return self.proc.poll()

    def kill_group(self, sig):
        """Send sig to the worker's whole process group (its pid: it leads its own
        session). The kernel keeps that number reserved while any member lives, so
        this also reaches children the worker left behind, and nobody else."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
