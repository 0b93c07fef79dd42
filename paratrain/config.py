"""Every ``PARATRAIN_*`` environment variable, in one table, read in one place.

The launcher, the tests and users set these per process; the code asks for a
setting by name (``config.get("PARATRAIN_TIMEOUT")``) and gets it parsed, or
its default when unset or empty, or a ``ValueError`` that names the variable,
what it held and what it takes. No other module reads ``PARATRAIN_*`` from
``os.environ``: a new setting is a row here and in the README's settings
table (tests/test_config.py holds the two together).

Values are read when asked for, not cached at import: ``pt.init()`` sets the
job id for the shm engine, and a benchmark worker sets its pretend hosts,
after paratrain is imported.
"""
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable


def size_bytes(text):
    """"4K" -> 4096, "1M", "16MiB", "64mb", "1G", "4096": binary units, as nccl-tests' -b/-e.
    Raises ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"bad size {text!r}: use bytes with an optional K/M/G suffix, e.g. 4K, 1M")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def flag(text):
    """Off for 0, false, no, off (any case); on for anything else, as 1 or yes."""
    return text.strip().lower() not in ("0", "false", "no", "off")


def checked(convert, ok, what):
    """A parser: convert the text, then refuse a value for which ok() is false."""
    def parse(text):
        value = convert(text)
        if not ok(value):
            raise ValueError(f"must be {what}")
        return value
    return parse


positive_size = checked(size_bytes, lambda v: v >= 1, "a positive number of bytes, e.g. 1048576 or 1M")
positive_seconds = checked(float, lambda v: 0 < v < math.inf, "a positive number of seconds")
seconds = checked(float, lambda v: 0 <= v < math.inf, "0 or a positive number of seconds")
count = checked(int, lambda v: v >= 0, "0 or more")
positive_count = checked(int, lambda v: v >= 1, "1 or more")


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any              # the parsed value when unset; None: the code decides
    parse: Callable[[str], Any]
    meaning: str              # one line, as in the README's table


SETTINGS = {s.name: s for s in (
    Setting("PARATRAIN_BACKEND", None, str, "`shm`, `hierarchical`, `torch`, `nccl`, `mpi`; unset: by host layout"),
    Setting("PARATRAIN_TIMEOUT", 300.0, positive_seconds, "seconds any wait may take before `CommTimeout`"),
    Setting("PARATRAIN_ALGO", None, str, "force an all-reduce algorithm (`direct`, `ring`, `tree`, `naive`, ...)"),
    Setting("PARATRAIN_DEBUG", False, flag, "1: check every call's collective/shape/dtype/op on every backend, and "
            "every point-to-point message's size and dtype (an envelope ahead of each)"),
    Setting("PARATRAIN_PRETEND_HOSTS", None, positive_count, "split the ranks into k pretend hosts"),
    Setting("PARATRAIN_CROSS_BACKEND", "torch", str, "engine between host leaders: `torch` (Gloo) or `mpi`"),
    Setting("PARATRAIN_SHM_SLOT_BYTES", 1 << 20, positive_size,
            "bytes per rank per round of a shm collective (bytes, or with K/M/G)"),
    Setting("PARATRAIN_SHM_CHUNK_BYTES", 1 << 20, positive_size,
            "payload per frame of a shm point-to-point message (bytes, or with K/M/G)"),
    Setting("PARATRAIN_CMA", True, flag, "0: never read peers' private memory with `process_vm_readv`"),
    Setting("PARATRAIN_SHM_SPIN_US", None, count, "microseconds a shm wait on the main thread spins before it "
            "sleeps; unset: 200, or 0 when the host's ranks outnumber its cores"),
    Setting("PARATRAIN_MPI_SPIN_US", None, count, "the same for the mpi backend"),
    Setting("PARATRAIN_THREADS", None, positive_count, "torch compute threads per worker (1 under `paratrain run`)"),
    Setting("PARATRAIN_KEEP_FREED_MEMORY", True, flag, "0: leave glibc's malloc as it is in launched workers "
            "and parameter servers (launch/heap.py: by default freed blocks up to 2 GiB stay in the heap for "
            "the next step)"),
    Setting("PARATRAIN_FORKSERVER", None, str, "the socket of a fork server (`python -m "
            "paratrain.launch.forkserver SOCKET`): workers start as forks of it, torch already imported"),
    Setting("PARATRAIN_WARM_START", True, flag, "0: `paratrain train` starts its workers as fresh interpreters "
            "(by default, unless PARATRAIN_FORKSERVER names one, it starts a fork server of its own first, "
            "which imports torch once while the front-end checks the options, and forks them from it)"),
    Setting("PARATRAIN_TRACE", None, str, "a folder: every rank records a trace there, merged into "
            "`trace.json` at the end (set by `paratrain run --trace DIR` and `paratrain train --trace`)"),
    Setting("PARATRAIN_FLIGHT_RECORDER", 2000, count, "collectives and messages each rank's flight recorder keeps "
            "(0: off); dumped on a timeout, a dead peer, a mismatch, SIGUSR1 or an uncaught exception"),
    Setting("PARATRAIN_FLIGHT_DIR", None, str, "where the flight recorder's dumps go (`paratrain train`: "
            "`runs/<id>/flight/`; unset elsewhere: a folder under the temporary directory, named by the error)"),
    Setting("PARATRAIN_STALL_S", 60.0, positive_seconds, "seconds a rank waits in a call before it logs which ranks "
            "it waits for and their stacks (`--stall-s`)"),
    Setting("PARATRAIN_ELASTIC", None, checked(int, lambda v: v >= 0, "a worker id, 0 or more"), "this worker's "
            "id in an elastic job (set by `paratrain run --min-workers`): pt.init() takes its rank from the "
            "launcher's rendezvous"),
    Setting("PARATRAIN_ELASTIC_TIMEOUT", 600.0, positive_seconds, "seconds an elastic job waits for a world "
            "of at least --min-workers before it gives up (`paratrain run --elastic-timeout`)"),
    Setting("PARATRAIN_ELASTIC_HEARTBEAT", 4.0, positive_seconds, "seconds an elastic job's worker may go without "
            "a heartbeat before the launcher declares it dead (a hung process or host: the others go on without it, "
            "and it is killed)"),
    Setting("PARATRAIN_JOB_ID", None, str, "names the job's shared-memory segments (set by `paratrain run`)"),
    Setting("PARATRAIN_PS_SHM", True, flag, "0: parameter-server tensors over TCP even on the same host"),
    Setting("PARATRAIN_PS_BELLS", True, flag, "0: same-host steps, dense pushes and pulls, and clocks through "
            "ZeroMQ instead of the doorbell pipes"),
    Setting("PARATRAIN_PS_SCHED_BATCH", True, flag,
            "0: `paratrain train --strategy ps` workers keep the default scheduling policy"),
    Setting("PARATRAIN_PS_TOKEN", None, str, "a shared secret: servers refuse requests whose header lacks its digest"),
    Setting("PARATRAIN_PS_ADDRS", None, str, "comma list of the servers' ZeroMQ addresses (set by `paratrain run "
            "--servers`; printed by `paratrain server`)"),
    Setting("PARATRAIN_PS_CHECKPOINT_SECONDS", 30.0, seconds,
            "a server checkpoints its shards this often, 0: only by clocks (and on a clean stop)"),
    Setting("PARATRAIN_PS_CHECKPOINT_CLOCKS", 0, count, "also every N clocks (0: off)"),
    Setting("PARATRAIN_PS_CHECKPOINT_DIR", None, str, "where a server keeps its checkpoints (set by the launcher)"),
    Setting("PARATRAIN_PS_INDEX", None, count, "a server's index (set by the launcher)"),
    Setting("PARATRAIN_PS_BIND", None, str, "the address a server binds (set by the launcher)"),
    Setting("PARATRAIN_PS_RESTART", 0, count, "how many times this server was restarted (set by the launcher)"),
)}


def get(name):
    """The setting's value from the environment, parsed; its default when unset or empty."""
    setting = SETTINGS[name]
    raw = os.environ.get(name, "")
    if raw == "":
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not valid ({e}); "
                         f"it is {setting.meaning}") from None


def require(name):
    """get(), for a variable the launcher always sets: missing means the process was not
    started by it."""
    value = get(name)
    if value is None:
        raise RuntimeError(f"{name} is not set: this process is meant to be started by paratrain's launcher")
    return value
