"""Parameter servers as the launcher sees them: their environment, where they
keep their checkpoints, and when one that died is started again.

A worker's death ends a synchronous job (watch.py), but a server can be
restarted alone: it saves its shards, optimizer state and clocks to its own
file in a checkpoint directory (``server-<index>.npz``, written by
paratrain.ps.server after registration, periodically and when it stops
cleanly), and a new process with the same index on the same address loads
that file. The workers keep their ZeroMQ sockets, which reconnect by
themselves, and resend what the dead process never answered (ps/client.py).
So a restart costs the updates since the last checkpoint, not the job.

A server that exits with a code before it ever said ``listening on`` failed at
its start (a port taken, a damaged checkpoint, a broken environment); a restart repeats that, so it
gets one more try, not the whole budget. The rule is "before listening" rather
than "within a second": importing torch alone takes a server seconds on a
busy machine.
"""
import os
import shutil
import sys
import tempfile
import threading

from . import binding
from .watch import describe_exit, say
from .worker import Worker

SERVER_MODULE = "paratrain.ps.server"
DEFAULT_RESTARTS = 3
FAREWELL_TIMEOUT = 10.0  # seconds the servers get to acknowledge that a worker left


def server_env(base, index, bind, job_id, checkpoints, timeout=None):
    """The environment paratrain.ps.server reads."""
    env = dict(base, PARATRAIN_PS_INDEX=str(index), PARATRAIN_PS_BIND=bind, PARATRAIN_JOB_ID=job_id,
               PARATRAIN_PS_CHECKPOINT_DIR=checkpoints, PARATRAIN_PS_RESTART="0", **binding.interpreter_env(1))
    if timeout is not None:
        env["PARATRAIN_TIMEOUT"] = f"{timeout:g}"
    return env


class ServerProcess(Worker):
    """One parameter server's process, labelled ``server <index>`` in the output.

    Beside what a Worker keeps, it notes whether the server has said it is
    listening, and how many times this server has been restarted."""

    def __init__(self, index, cmd, env, prefix=True, restarts=0):
        super().__init__(index, index, cmd, env, prefix=prefix, on_line=self._note_listening,
                         label=f"server {index}")
        self.restarts = restarts
        self.listening = False

    def _note_listening(self, worker, stream_name, text):
        if text.startswith("listening on"):
            self.listening = True
        return False  # only a look: the line is still printed

    def again(self):
        """A new (not yet started) process for the same server: the same index,
        address, checkpoint directory and output label, one more restart."""
        env = dict(self.env, PARATRAIN_PS_RESTART=str(self.restarts + 1))
        return ServerProcess(self.rank, self.cmd, env, prefix=bool(self.prefix), restarts=self.restarts + 1)


def make_servers(addrs, base_env, job_id, checkpoints, timeout=None, prefix=True, binds=None):
    """One ServerProcess per address. ``binds`` (default: the addresses) is where
    each listens, when that differs from where workers reach it (0.0.0.0)."""
    return [ServerProcess(i, [sys.executable, "-m", SERVER_MODULE],
                          server_env(base_env, i, bind, job_id, checkpoints, timeout), prefix=prefix)
            for i, bind in enumerate(binds or addrs)]


class Restarts:
    """The restart policy: ``replace(server)`` gives a started process in place of
    a server that ended, or None when the job should stop instead. Each server
    may be restarted ``limit`` times."""

    def __init__(self, limit, command="paratrain run", option="--server-restarts"):
        self.limit = limit
        self.command, self.option = command, option  # how the launcher and its option are named in messages
        self.false_starts = {}  # server index -> exits with a code before listening

    def replace(self, server):
        rc = server.proc.returncode
        if rc == 0:  # stopped on purpose (SIGTERM makes it save and exit 0): not for us to undo
            server.note = "on its own while the workers still ran"
            return None
        false_start = rc > 0 and not server.listening
        if false_start:
            self.false_starts[server.rank] = self.false_starts.get(server.rank, 0) + 1
        if self.false_starts.get(server.rank, 0) > 1:
            server.note = "before listening, again (not restarted: it would fail the same way)"
            return None
        if server.restarts >= self.limit:
            times = f"{server.restarts} restart{'s' * (server.restarts != 1)}"
            server.note = f"after {times} ({self.option} {self.limit})"
            return None
        new = server.again()
        why = "; it never listened, so it gets one more try" if false_start else ""
        say(f"{self.command}: {server.label} {describe_exit(rc, hint=False)}; restarting it from its last "
            f"checkpoint (restart {new.restarts} of {self.limit}){why}")
        try:
            # Forking while output threads run (unlike at the job's start) is safe here: the
            # child only calls prctl and getppid before exec (parent.tie_to_parent).
            new.start()
        except OSError as e:
            server.note = f"and could not be started again: {e}"
            return None
        new.start_output()
        return new


class Checkpoints:
    """Where the servers keep their checkpoints during one job.

    Given (--server-checkpoints DIR): that directory, created if missing and
    never removed; servers that find their file there at start resume from
    it, so a later job can pick up where this one stopped. Not given: a fresh
    directory under the system's temp area (nothing appears in the working
    directory of a user who never asked for checkpoints), removed when the job
    succeeds or when it was left empty, kept and named on stderr when the job
    failed, so its state can be looked at or resumed with --server-checkpoints."""

    def __init__(self, given, job_id):
        self.ours = not given
        if given:
            self.path = os.path.abspath(given)
            os.makedirs(self.path, exist_ok=True)
        else:
            self.path = tempfile.mkdtemp(prefix=f"paratrain-ps-{job_id}-")

    def finish(self, succeeded, command="paratrain run", option="--server-checkpoints"):
        if not self.ours:
            return
        if succeeded or not os.listdir(self.path):
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            say(f"{command}: the parameter servers' checkpoints are kept in {self.path} "
                f"(pass {option} {self.path} to start servers from them)")


def check_checkpoint_dir(path, option):
    """An error message when ``path`` cannot serve as a checkpoint directory, else None."""
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        return f"{option} {path} exists and is not a directory"
    return None


def farewell_in_background(addrs, rank, world_size, command="paratrain run"):
    """Tell the servers that ``rank`` has left the job (ps.client.farewell), from a
    thread: the servers may be restarting and take seconds to answer, while the
    launcher keeps watching. Returns the thread."""
    def run():
        from ..ps.client import farewell  # imports torch: only when a worker is lost
        try:
            ok = farewell(addrs, worker=rank, workers=world_size, timeout=FAREWELL_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - reported; the job goes on either way
            ok, why = False, f" ({type(e).__name__}: {e})"
        else:
            why = f" within {FAREWELL_TIMEOUT:g}s"
        if not ok:
            say(f"{command}: the parameter servers did not acknowledge that rank {rank} left{why}; "
                "with SSP the others may wait for it until PARATRAIN_TIMEOUT")
    t = threading.Thread(target=run, daemon=True, name=f"paratrain-farewell-{rank}")
    t.start()
    return t


def parse_addrs(text):
    """``tcp://host:port,...`` -> (list of addresses, None) or (None, an error message)."""
    addrs = [a.strip() for a in text.split(",") if a.strip()]
    if not addrs:
        return None, "--ps-addrs is empty"
    for a in addrs:
        host, _, port = a[len("tcp://"):].rpartition(":") if a.startswith("tcp://") else ("", "", "")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return None, f"--ps-addrs: {a!r} is not tcp://HOST:PORT (the line `paratrain server` prints)"
    return addrs, None
