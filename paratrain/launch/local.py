"""``paratrain run``: start N workers on this machine, like torchrun.

    paratrain run -n 4 train.py --lr 0.1
    paratrain run --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 -n 2 train.py
    paratrain run -n 2 -m some.module args
    paratrain run --servers 2 -n 4 train.py          (and 2 parameter servers, servers.py)
    paratrain run --ps-addrs tcp://h:29600,... -n 4 train.py   (servers started by `paratrain server`)

One launcher per machine. It gives every worker the environment that
``pt.init()`` (and torch.distributed) reads: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; plus one compute thread
per worker unless told otherwise (N workers each running a full-width OpenMP
pool on fewer cores than N*threads thrash), and a job id that names the job's
shared-memory segments. Then it watches them (watch.py) and, once they have
ended, removes any segment a worker killed during set-up could not unlink.
"""
import argparse
import errno
import glob
import os
import secrets
import socket
import sys

from ..train.argtypes import positive_float
from . import binding, elastic, trace_files
from . import servers as ps
from .watch import LauncherSignals, Policy, say, stop, supervise
from .worker import Worker

DEFAULT_MULTINODE_PORT = 29500  # torchrun's default
SHM_DIR = "/dev/shm"
MAX_LOCAL_WORKERS = 1024   # -n above it is a typo, not a job (and would exhaust memory before the first spawn)
BOOTSTRAP = "paratrain.launch.bootstrap"   # runs the script, then exits without the interpreter's teardown
MAX_TIMEOUT = 365 * 86400.0   # a year; far beyond, the engines overflow (1e30 s: "too large to convert to C int")


EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"
_HANDED_OUT = set()   # ports this process chose already: a job's master and its servers differ


def _ephemeral_low():
    """The lowest port the kernel hands to outgoing connections (Linux's default 32768)."""
    try:
        with open(EPHEMERAL_PORTS) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host="127.0.0.1"):
    """A TCP port that was free a moment ago, for rank 0 or a server to bind soon after.
    Chosen at random below the kernel's ephemeral range and tried: a port bind(0)
    returns is one from that range, which any process's next outgoing connection
    (a Gloo or ZeroMQ peer of a job running beside this one) may take as its own
    before rank 0 binds it, and did, once in a suite of 1069 tests. Falls back to
    bind(0), torchrun's way, where no port below the range is free."""
    import random
    low = _ephemeral_low()
    tries = [random.SystemRandom().randrange(max(1024, low - 16384), low) for _ in range(64)] if low > 2048 else []
    for port in tries:
        if port not in _HANDED_OUT and bind_error(port) is None:   # every interface, as the store listens
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_error(port, host=""):
    """The OSError binding host:port raises, or None if something could listen
    there now. The wildcard address by default (the rendezvous store listens on
    all interfaces), with SO_REUSEADDR, so a port merely in TIME_WAIT from the
    previous run counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def port_in_use(port):
    """True if nothing on this machine could listen on port."""
    e = bind_error(port)
    return e is not None and e.errno == errno.EADDRINUSE


def build_parser():
    p = argparse.ArgumentParser(
        prog="paratrain run", allow_abbrev=False,
        description="Start worker processes running a script (or a module), like torchrun. "
                    "Options go before the script; everything after it goes to the script unchanged.")
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=2,
                   help="workers on this machine (default 2)")
    p.add_argument("--nnodes", type=int, default=1, help="machines in the job, one launcher each (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   help="this machine's index among the nnodes (default 0)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1",
                   help="host of rank 0, where the rendezvous runs (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help=f"rendezvous port (default: a free one with one node, {DEFAULT_MULTINODE_PORT} with several)")
    p.add_argument("--threads", type=int, default=1, help="compute threads per worker (default 1)")
    p.add_argument("--bind-to", "--bind_to", dest="bind_to", choices=binding.MODES, default="none",
                   help="pin each worker to its own --threads CPUs (core), as mpirun --bind-to core, "
                        "or let the kernel place them (none, the default)")
    p.add_argument("--servers", type=int, default=0,
                   help="parameter servers to start beside the workers (paratrain.ps; single node)")
    p.add_argument("--server-checkpoints", metavar="DIR", default=None,
                   help="where the servers keep checkpoints, kept after the job; servers resume from what "
                        "they find there (default: a new temporary directory, removed when the job succeeds)")
    p.add_argument("--server-restarts", metavar="K", type=int, default=ps.DEFAULT_RESTARTS,
                   help="times each server that dies is restarted from its checkpoint before the job "
                        f"stops (default {ps.DEFAULT_RESTARTS})")
    p.add_argument("--ps-addrs", metavar="ADDRS", default=None,
                   help="use parameter servers started elsewhere (`paratrain server` prints the value: "
                        "tcp://HOST:PORT,...); starts none here; works with --nnodes")
    p.add_argument("--link", metavar="RATE", default=None,
                   help="pretend hosts joined by a slow link: the --nnodes nodes run here, in a private network "
                        "namespace whose loopback is limited to RATE (e.g. 1gbit; needs root; launch/link.py)")
    p.add_argument("--inside-link", action="store_true", help=argparse.SUPPRESS)   # launch/link.py
    p.add_argument("--worker-failure", choices=("stop", "continue"), default="stop",
                   help="when a worker dies: stop the job (default), or go on without it and tell the "
                        "parameter servers it left (asynchronous training: ASP, SSP)")
    elastic.add_options(p, "-n")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds any wait in paratrain.comm may take (exported as PARATRAIN_TIMEOUT)")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="every worker records a trace into DIR (PARATRAIN_TRACE); at the end they are merged into "
                        "DIR/trace.json, which Perfetto opens and `paratrain trace DIR` reads")
    p.add_argument("--stall-s", type=positive_float, default=None, metavar="S",
                   help="seconds a worker waits in a call before it logs which ranks it waits for and their stacks "
                        "(PARATRAIN_STALL_S, default 60)")
    p.add_argument("--flight-dir", default=None, help=argparse.SUPPRESS)   # paratrain train: runs/<id>/flight
    p.add_argument("--trace-out", default=None, help=argparse.SUPPRESS)   # paratrain train: where trace.json goes
    p.add_argument("--no-prefix", dest="prefix", action="store_false",
                   help="do not prefix workers' output lines with [rank R]")
    p.add_argument("-m", "--module", action="store_true",
                   help="the target is a module to run as `python -m MODULE`, not a script file")
    p.add_argument("script", nargs="?", help="the script (or, with -m, the module) each worker runs")
    p.add_argument("args", nargs="*", help="arguments for the script, passed through unchanged")
    return p


def split_argv(parser, argv):
    """(launcher options, script, script args).

    The script is the first word that is neither an option nor an option's
    value. We cut there ourselves rather than using argparse.REMAINDER,
    because argparse drops a ``--`` found among the script's own arguments."""
    takes_value = {}
    for action in parser._actions:  # argparse has no public list of its options
        for opt in action.option_strings:
            takes_value[opt] = action.nargs != 0
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            i += 1
            break
        if not tok.startswith("-") or tok == "-":
            break
        name = tok.split("=", 1)[0]
        if name not in takes_value and not tok.startswith("--") and tok[:2] in takes_value:
            name = tok[:2]  # -n4
        if takes_value.get(name) and name == tok:
            i += 2  # "-n 4": the value is the next word
        else:
            i += 1  # a flag, "--x=v", "-n4", or an unknown option argparse will reject
    opts = [a for a in argv[:i] if a != "--"]
    if i >= len(argv):
        return opts, None, []
    return opts, argv[i], argv[i + 1:]


def node_ranks(args):
    """The global ranks of this node's workers."""
    return range(args.node_rank * args.nproc, (args.node_rank + 1) * args.nproc)


def worker_env(base, args, local_rank, port, job_id, worker_id=None):
    """The launcher's environment, with the job's own variables set. What an outer
    torchrun left that this job does not set (ROLE_*, TORCHELASTIC_*) is dropped,
    so a worker never sees another job's values beside this one's."""
    env = {k: v for k, v in base.items() if not k.startswith(("ROLE_", "TORCHELASTIC_"))}
    env.update({
        "RANK": str(args.node_rank * args.nproc + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(args.nnodes * args.nproc),
        "LOCAL_WORLD_SIZE": str(args.nproc),
        "GROUP_RANK": str(args.node_rank),
        "GROUP_WORLD_SIZE": str(args.nnodes),   # torchrun's names for the node's index and the node count
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(port),
        "PARATRAIN_JOB_ID": job_id,
        "PARATRAIN_THREADS": str(args.threads),
        **binding.interpreter_env(args.threads),
    })
    if args.min_workers is not None:   # its worker id, for life (a replacement's is new)
        env["PARATRAIN_ELASTIC"] = str(args.node_rank * args.nproc + local_rank if worker_id is None else worker_id)
    if args.timeout is not None:
        env["PARATRAIN_TIMEOUT"] = f"{args.timeout:g}"
    return env


def server_addresses(args):
    """One free port per parameter server, on the master's address."""
    return [f"tcp://{args.master_addr}:{free_port()}" for _ in range(args.servers)]


def remove_leftover_segments(job_id):
    """The shm engine unlinks its segment names right after set-up; a worker
    killed during those milliseconds leaves one behind. Job ids are hex, so
    the trailing dash keeps another job's names out of the pattern."""
    for path in glob.glob(os.path.join(SHM_DIR, f"paratrain-{job_id}-*")):
        try:
            os.unlink(path)
        except OSError:
            pass


def _check(args):
    """Errors found before anything is spawned; returns a message or None."""
    if args.script is None:
        return "missing the script to run (paratrain run [options] script.py [args])"
    for name, value in (("-n/--nproc-per-node", args.nproc), ("--nnodes", args.nnodes), ("--threads", args.threads)):
        if value < 1:
            return f"{name} must be at least 1, got {value}"
    if args.nproc > MAX_LOCAL_WORKERS:
        return (f"-n/--nproc-per-node {args.nproc} is more workers than one machine can run "
                f"(at most {MAX_LOCAL_WORKERS}); start a launcher on each machine with --nnodes")
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank must be between 0 and --nnodes - 1 = {args.nnodes - 1}, got {args.node_rank}"
    if args.timeout is not None and not 0 < args.timeout <= MAX_TIMEOUT:   # also refuses nan and inf
        return (f"--timeout must be a positive number of seconds, at most {MAX_TIMEOUT:g} (a year), "
                f"got {args.timeout:g}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        return f"--master-port must be between 1 and 65535, got {args.master_port}"
    return _check_elastic(args) or _check_servers(args) or _check_script(args)


def _check_elastic(args):
    if args.min_workers is None:
        if args.max_workers is not None or args.elastic_timeout is not None or args.max_restarts \
                or args.replica_size != 1:
            return ("--max-workers, --max-restarts, --replica-size and --elastic-timeout are for an elastic job: "
                    "give --min-workers too")
        return None
    problem = elastic.check_sizes(args.min_workers, args.nnodes * args.nproc, args.max_workers, args.max_restarts,
                                  args.elastic_timeout, "-n" if args.nnodes == 1 else "--nnodes x -n",
                                  args.replica_size)
    if problem:
        return problem
    if args.servers or args.ps_addrs:
        return "--min-workers is for synchronous training; the parameter server takes lost workers with " \
               "--worker-failure continue"
    return None


def _check_servers(args):
    if args.servers < 0 or args.server_restarts < 0:
        return "--servers and --server-restarts must be >= 0"
    if args.servers and args.ps_addrs is not None:
        return "--servers starts parameter servers, --ps-addrs uses servers started elsewhere: give one of them"
    if args.servers and args.nnodes > 1:
        return ("--servers starts parameter servers beside one node's workers; with --nnodes > 1 start them "
                "with `paratrain server` and pass its --ps-addrs value to every node's `paratrain run`")
    if args.server_checkpoints is not None and not args.servers:
        return "--server-checkpoints is for the servers --servers starts"
    if args.ps_addrs is not None:
        problem = ps.parse_addrs(args.ps_addrs)[1]
        if problem:
            return problem
    return ps.check_checkpoint_dir(args.server_checkpoints, "--server-checkpoints")


def _check_script(args):
    if args.module:
        return None
    where = "" if os.path.isabs(args.script) else f" (looked in {os.getcwd()})"
    if os.path.isdir(args.script):
        if os.path.isfile(os.path.join(args.script, "__main__.py")):
            return None   # python runs a directory's __main__.py, and so do we
        return f"{args.script!r} is a directory without a __main__.py{where}: name the script inside it"
    if not os.path.exists(args.script):
        return f"script {args.script!r} not found{where}"
    if not os.path.isfile(args.script):
        return f"{args.script!r} is not a regular file{where}: name a Python script"
    return None


def _choose_port(args):
    if args.master_port is None:
        return (free_port() if args.nnodes == 1 else DEFAULT_MULTINODE_PORT), None
    if args.nnodes == 1 and port_in_use(args.master_port):
        return None, (f"--master-port {args.master_port} is already in use on this machine; "
                      "pick another port, or omit --master-port and a free one is chosen")
    return args.master_port, None


def main(argv=None, on_line=None):
    """Run the launcher; returns the exit code (see watch.supervise).

    on_line(worker, stream_name, text) sees each line a worker prints, before it
    is relayed; returning True consumes it (see worker.Worker)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    opts, script, script_args = split_argv(parser, argv)
    try:
        args = parser.parse_args(opts + ([] if script is None else ["--", script]))
    except SystemExit as e:  # --help, or a bad option: argparse has printed why
        return e.code if isinstance(e.code, int) else 2
    args.args = script_args
    if args.link is not None:
        from . import link
        if not args.inside_link:
            problem = link.check(args.link)
            if problem is not None:
                say(f"paratrain run: error: {problem}")
                return 2
            import subprocess
            return subprocess.call(link.command(args.link, sys.executable, argv))
        link.as_pretend_hosts(args)
    problem = _check(args)
    if problem is None:
        port, problem = _choose_port(args)
    if problem is not None:
        say(f"paratrain run: error: {problem}")
        return 2
    if args.nnodes > 1 and args.master_addr in ("127.0.0.1", "localhost"):
        say(f"paratrain run: warning: --nnodes {args.nnodes} with --master-addr {args.master_addr}: "
            "workers on other machines cannot reach that; pass the address of node 0")

    job_id = f"{os.getpid():x}{secrets.token_hex(3)}"
    script = os.path.join(os.curdir, args.script) if args.script.startswith("-") else args.script   # not options
    target = ["-m", args.script] if args.module else [script]
    cmd = [sys.executable, "-m", BOOTSTRAP, *target, *args.args]
    base = dict(os.environ)
    trace_dir = args.trace or base.get("PARATRAIN_TRACE") or None
    if args.stall_s is not None:
        base["PARATRAIN_STALL_S"] = repr(args.stall_s)
    if args.flight_dir:
        base["PARATRAIN_FLIGHT_DIR"] = args.flight_dir
    if trace_dir:
        trace_dir = base["PARATRAIN_TRACE"] = os.path.abspath(trace_dir)
        trace_files.remove_old(trace_dir, node_ranks(args), args.nnodes * args.nproc)
    addrs = ps.parse_addrs(args.ps_addrs)[0] if args.ps_addrs is not None else server_addresses(args)
    if addrs:
        base["PARATRAIN_PS_ADDRS"] = ",".join(addrs)
    cpus = worker_cpus(args)
    coordinator = None
    if args.min_workers is not None:
        coordinator, problem = elastic.start_coordinator(args, port, base)
        if problem:
            say(f"paratrain run: error: {problem}")
            return 2
    workers = [Worker(args.node_rank * args.nproc + i, i, cmd, worker_env(base, args, i, port, job_id),
                      prefix=args.prefix, on_line=on_line, cpus=cpus[i]) for i in range(args.nproc)]
    checkpoints, servers = None, []
    if args.servers:
        try:
            checkpoints = ps.Checkpoints(args.server_checkpoints, job_id)
        except OSError as e:
            say(f"paratrain run: error: cannot make the servers' checkpoint directory: {e}")
            return 2
        servers = ps.make_servers(addrs, base, job_id, checkpoints.path, args.timeout, args.prefix)
    policy = _policy(args, addrs, coordinator)
    if coordinator is not None and args.max_restarts:
        policy.replace_worker = elastic.Replacements(
            args, cmd, on_line, cpus, coordinator, lambda local_rank, wid: worker_env(base, args, local_rank, port,
                                                                                      job_id, wid))
    rc = 1
    try:
        rc = start_and_watch(workers, servers, policy)
        if coordinator is not None:
            coordinator.wait_for_other_hosts()   # the store they meet at is ours
        if trace_dir:
            trace_files.merge(trace_dir, args.trace_out, node_ranks(args), args.nnodes * args.nproc)
        return rc
    finally:
        if coordinator is not None:
            coordinator.stop()
        if policy.replace_worker is not None:
            policy.replace_worker.stop()
        remove_leftover_segments(job_id)
        if checkpoints is not None:
            checkpoints.finish(rc == 0)


def worker_cpus(args):
    """Each local worker's CPU set for --bind-to (None: unbound), with a note
    when bound workers must share CPUs."""
    available = binding.available_cpus()
    sets = binding.cpu_sets(args.bind_to, args.nproc, args.threads, available)
    if args.bind_to != "none" and binding.oversubscribed(args.nproc, args.threads, available):
        say(f"paratrain run: note: --bind-to {args.bind_to} with {args.nproc} workers x {args.threads} "
            f"thread(s) on {len(available)} CPUs: workers share CPUs ({binding.describe(sets)})")
    return sets


def _policy(args, addrs, coordinator=None):
    world_size = args.nnodes * args.nproc
    if coordinator is not None:   # a lost worker is left behind; the others form a new world without it
        def left(w):
            coordinator.lost(w.rank)
        return Policy(worker_failure="continue", worker_lost=left, restarts=ps.Restarts(args.server_restarts),
                      lost_note="elastic: the others form a world without it",
                      worker_finished=lambda w: coordinator.finished(w.rank))

    def farewell(w):
        return ps.farewell_in_background(addrs, w.rank, world_size)
    lost = farewell if addrs and args.worker_failure == "continue" else None
    return Policy(worker_failure=args.worker_failure, restarts=ps.Restarts(args.server_restarts),
                  worker_lost=lost)


def start_and_watch(workers, servers, policy):
    """Start the servers, then the workers, and watch them (watch.supervise);
    returns the exit code. Also used by ``paratrain server`` (no workers)."""
    started = []
    # Handlers first: a forked worker can be running before supervise() is reached,
    # and a signal in that window must stop the job, not kill the launcher outright.
    with LauncherSignals() as signals:
        try:
            for w in servers + workers:
                w.start()
                started.append(w)
        except OSError as e:
            say(f"{policy.command}: error: could not start {w.label} ({' '.join(w.cmd)}): {e}")
            stop(started, signals)
            return 1
        reasons = sorted({w.fresh_because for w in started if w.fresh_because})
        if reasons:
            say(f"{policy.command}: note: PARATRAIN_FORKSERVER is set, but workers start fresh: {'; '.join(reasons)}")
        for w in started:
            w.start_output()
        return supervise(workers, servers=servers, policy=policy, signals=signals)
