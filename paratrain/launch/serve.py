"""``paratrain server``: the parameter servers of a multi-node job, on this host.

    paratrain server --servers 2 --port 29600                     (on the server host)
    paratrain run --ps-addrs tcp://HOST:29600,tcp://HOST:29601 \\
        --nnodes 2 --node-rank R --master-addr NODE0 -n 4 train.py  (on every node)

``paratrain run --servers`` starts servers beside one node's workers, at
ports it picks. Workers on several machines need the servers at addresses
known before any of them starts, so the servers get a command of their own:
S servers on ports port .. port+S-1, one line on stdout with the
PARATRAIN_PS_ADDRS value the workers use, a dead server restarted from its
checkpoint like under ``paratrain run`` (servers.py), and on Ctrl-C or SIGTERM
every server stopped (each saves its checkpoint as it stops) with exit code
130 or 143, nothing left behind.
"""
import argparse
import errno
import os
import secrets
import socket
import sys

from . import servers as ps
from .local import bind_error, start_and_watch
from .watch import Policy, say

COMMAND = "paratrain server"
DEFAULT_PORT = 29600


def build_parser():
    p = argparse.ArgumentParser(
        prog=COMMAND, allow_abbrev=False,
        description="Run parameter servers on this host for workers started elsewhere with "
                    "`paratrain run --ps-addrs ...`; stop them with Ctrl-C.")
    p.add_argument("--servers", type=int, default=1, help="servers to run (default 1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port of the first server; server i listens on port + i (default {DEFAULT_PORT})")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: all interfaces)")
    p.add_argument("--advertise", metavar="HOST", default=None,
                   help="the host name workers reach this machine by (default: its name, "
                        f"{socket.gethostname()})")
    p.add_argument("--checkpoints", metavar="DIR", default=None,
                   help="where the servers keep checkpoints, kept after they stop; they resume from what they "
                        "find there (default: a new temporary directory, removed when they are stopped)")
    p.add_argument("--restarts", metavar="K", type=int, default=ps.DEFAULT_RESTARTS,
                   help=f"times each server that dies is restarted from its checkpoint (default {ps.DEFAULT_RESTARTS})")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a request may wait on the servers (exported as PARATRAIN_TIMEOUT)")
    return p


def _check(args):
    """Errors found before anything is spawned; returns a message or None."""
    if args.servers < 1 or args.restarts < 0:
        return f"--servers must be at least 1 and --restarts at least 0, got {args.servers} and {args.restarts}"
    if not 0 < args.port or args.port + args.servers - 1 > 65535:
        return f"--port {args.port} with {args.servers} servers needs ports up to {args.port + args.servers - 1}; " \
               "ports go from 1 to 65535"
    if args.timeout is not None and args.timeout <= 0:
        return f"--timeout must be a positive number of seconds, got {args.timeout:g}"
    for port in range(args.port, args.port + args.servers):
        e = bind_error(port, "" if args.host in ("0.0.0.0", "*") else args.host)
        if e is not None and e.errno == errno.EADDRINUSE:
            return f"port {port} is already in use on this machine; pick another --port " \
                   f"(server i listens on --port + i)"
        if e is not None:
            return f"cannot listen on {args.host}:{port}: {e.strerror or e}"
    return ps.check_checkpoint_dir(args.checkpoints, "--checkpoints")


def main(argv=None):
    """Run the servers until interrupted; returns the exit code (128 + the signal
    when stopped by one, as watch.supervise; non-zero when a server cannot be
    kept running)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    problem = _check(args)
    if problem is not None:
        say(f"{COMMAND}: error: {problem}")
        return 2
    job_id = f"{os.getpid():x}{secrets.token_hex(3)}"
    try:
        checkpoints = ps.Checkpoints(args.checkpoints, job_id)
    except OSError as e:
        say(f"{COMMAND}: error: cannot make the checkpoint directory: {e}")
        return 2
    ports = range(args.port, args.port + args.servers)
    advertise = args.advertise or socket.gethostname()
    addrs = [f"tcp://{advertise}:{p}" for p in ports]
    servers = ps.make_servers(addrs, dict(os.environ), job_id, checkpoints.path, args.timeout,
                              binds=[f"tcp://{args.host}:{p}" for p in ports])
    kept = "kept" if args.checkpoints else "removed when they stop; --checkpoints DIR keeps them"
    say(f"{COMMAND}: {args.servers} parameter server{'s' * (args.servers > 1)} on {args.host}; Ctrl-C stops them. "
        f"Checkpoints in {checkpoints.path} ({kept})\n"
        f"{COMMAND}: on every node: paratrain run --ps-addrs {','.join(addrs)} [--nnodes N --node-rank R ...] "
        "script.py")
    print(f"PARATRAIN_PS_ADDRS={','.join(addrs)}", flush=True)
    rc = 1
    try:
        policy = Policy(command=COMMAND, restarts=ps.Restarts(args.restarts, COMMAND, "--restarts"))
        rc = start_and_watch([], servers, policy)
        return rc
    finally:
        checkpoints.finish(rc in (130, 143), COMMAND, "--checkpoints")
