"""pt.init(), pt.world(), pt.new_group(): building the groups a job talks over.

The backend is chosen from where the ranks are:

- all ranks on one host: ``shm``, our shared-memory engine;
- ranks on several hosts: ``hierarchical``: shm inside each host and a proven
  engine (Gloo through torch.distributed, or MPI) among one leader per host,
  as Horovod joins NCCL inside a node with MPI between nodes;
- ``backend="torch"`` (Gloo, or NCCL with ``backend="nccl"``) or
  ``backend="mpi"`` force one engine for everything.
"""
import atexit
import dataclasses
import importlib
import os
import sys
import threading
from datetime import timedelta

import torch
from torch.distributed import PrefixStore

from .. import config
from . import abandon
from . import env as envmod
from . import rendezvous
from .errors import CommError, first_line
from .liveness import dead_local_peers
from .group import timeout_from_env

BACKENDS = ("shm", "torch", "gloo", "nccl", "mpi", "hierarchical")
_ENGINE = {"gloo": "torch"}   # two names of one backend


class _State:
    world = None
    store = None
    env = None
    hosts = None  # host index of every global rank
    procs = None  # (host, pid) of every global rank, for telling a dead peer (liveness.py)
    backend = None
    group_count = 0
    groups = ()  # the sub-groups new_group made, destroyed with the world
    torch_initialized = False
    watchdog = None   # the stall inspector (trace/stall.py)


_S = _State()


def is_initialized():
    return _S.world is not None


def init(backend=None, timeout=None, threads=None):
    """Join the job described by the environment and return the world group.

    backend: None (shm on one host, hierarchical across hosts), "shm", "torch"
    (Gloo), "nccl", "mpi" or "hierarchical"; PARATRAIN_BACKEND sets it too.
    timeout: seconds any wait may take before it raises (PARATRAIN_TIMEOUT, default 300).
    threads: compute threads for torch in this process (PARATRAIN_THREADS, set to 1
    by ``paratrain run``; a machine may have fewer cores than workers).
    Called again, it returns the same world; asked then for another backend, it
    raises rather than hand back a group on the engine the caller did not ask for
    (torch.distributed refuses a second init_process_group too).
    """
    if _S.world is not None:
        if backend is not None and _ENGINE.get(backend, backend) != _ENGINE.get(_S.backend, _S.backend):
            raise CommError(f"paratrain is already initialized with backend {_S.backend!r}, so "
                            f"pt.init(backend={backend!r}) cannot switch it; call pt.destroy() first")
        return _S.world
    backend = backend or config.get("PARATRAIN_BACKEND")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    timeout = timeout_from_env() if timeout is None else float(timeout)
    threads = threads or config.get("PARATRAIN_THREADS")
    if threads:
        torch.set_num_threads(int(threads))

    if backend == "mpi":
        from .mpi_backend import mpi_world
        _S.world, _S.backend = mpi_world(timeout), "mpi"
        _S.world.trace_name = "world"
        _start_trace(_S.world, _S.world.rank)
        _S.store = _side_store(_S.world, timeout)
        if _S.store is None:
            from ..trace import flight
            flight.install(_S.world.rank, _S.world.world_size)
        else:
            _S.watchdog = _start_watchdog(_S.store, _S.world.rank, _S.world.world_size)
        return _S.world

    e = envmod.read_env()
    worker_id = config.get("PARATRAIN_ELASTIC")
    if worker_id is not None:
        e, store = _elastic_world(e, worker_id, timeout)
    else:
        store = _job_store(e, timeout)
    _S.env = e
    rendezvous.wait_for_ranks(store, e.rank, e.world_size, timeout)
    _S.store = store
    if e.rank == 0:
        store.set("job_id", config.get("PARATRAIN_JOB_ID") or f"{os.getpid():x}")
    os.environ.setdefault("PARATRAIN_JOB_ID", store.get("job_id").decode())
    _S.procs = _processes(store, e.rank, e.world_size, timeout)
    _S.hosts = _host_layout([host for host, _ in _S.procs])
    if backend is None:
        backend = "shm" if len(set(_S.hosts)) == 1 else "hierarchical"
    if backend == "shm" and len(set(_S.hosts)) > 1:
        raise CommError(f"backend='shm' needs all ranks on one host, but they span {len(set(_S.hosts))} hosts; "
                        "use backend='hierarchical' (the default) or 'torch'")
    rendezvous.agree(store, "backend", e.rank, e.world_size, _ENGINE.get(backend, backend), timeout,
                     "pass every rank the same pt.init(backend=...) or PARATRAIN_BACKEND", _S.procs)
    _S.backend = backend
    _S.world = _make_group(list(range(e.world_size)), e.rank, backend, timeout, world=True)
    _start_trace(_S.world, e.rank)
    _S.watchdog = _start_watchdog(_S.store, e.rank, e.world_size)
    return _S.world


def _side_store(world, timeout):
    """Under mpirun, which gives no store: rank 0 serves one on a free port and tells the
    others where, in one broadcast over MPI, for the stall inspector. None for a world
    of one, or (with a note) where the others cannot reach it: the job runs without."""
    import socket

    from torch.distributed import TCPStore
    if world.world_size < 2:
        return None
    store = where = None
    if world.rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        store = TCPStore(host, 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
        where = f"{host} {store.port}"
    where = broadcast_text(world, where, 0)
    if store is not None:
        return store
    host, port = where.split()
    try:
        return rendezvous.connect_client(host, int(port), min(timeout, 30.0))
    except rendezvous.RendezvousError as e:
        print(f"paratrain: rank {world.rank}: no stall inspector: {e}", file=sys.stderr, flush=True)
        return None


def broadcast_text(group, text, root=0):
    """``text`` from ``root`` to every rank of ``group`` (collective; the others pass None):
    its length, then its UTF-8 bytes, each by broadcast. Nothing is unpickled."""
    if group.rank == root:
        raw = bytearray(text.encode())
        data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    group.broadcast(size, root)
    if group.rank != root:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.broadcast(data, root)
    return text if group.rank == root else bytes(data.numpy()).decode()


def _start_watchdog(store, rank, world_size):
    """The flight recorder, and the stall inspector's watchdog over the job's store (trace/)."""
    from ..trace import flight, stall
    if flight.install(rank, world_size) is None or world_size < 2:
        return None
    dog = stall.Watchdog(PrefixStore("stall", store), rank, world_size, config.get("PARATRAIN_STALL_S"))
    dog.start()
    return dog


def _start_trace(world, rank):
    """With PARATRAIN_TRACE set: this rank's clock offset to rank 0's (one exchange
    with rank 0 over the world group), then record from here on (trace/). Once per
    process: a later pt.init() goes on recording into the same file."""
    from .. import trace
    worker_id = config.get("PARATRAIN_ELASTIC")
    # An elastic world is re-formed with workers that record already and one that joins:
    # every rank then measures (the estimate is collective), and a file is named by the
    # worker's id, which it keeps for life, not by its rank, which moves.
    if config.get("PARATRAIN_TRACE") and (not trace.enabled() or worker_id is not None):
        from ..trace import clock
        offset, uncertainty = clock.estimate(world)
        trace.start_from_env("rank", rank if worker_id is None else worker_id, offset, uncertainty,
                             world_size=world.world_size, backend=_S.backend)


_STORES = {}   # (addr, port, rank, world size) -> [the rendezvous store, inits over it so far]


def _job_store(e, timeout):
    """The rendezvous store of this init: one connection per process, kept across
    pt.destroy(), with a fresh key prefix for each pt.init() over it.

    Why not a new TCPStore per init: rank 0's server then lives as long as
    anything still references the old one (a group a script kept), so the next
    init finds the port in use; and a rank quicker than rank 0 to re-init
    connects to the old server and reads the last round's keys (a freed
    shared-memory segment's name, Gloo's old addresses). Every rank inits the
    same number of times, as with torch.distributed, so the n-th init of every
    rank meets under the same prefix ``init<n>/``."""
    key = (e.master_addr, e.master_port, e.rank, e.world_size)
    entry = _STORES.get(key)
    if entry is None:
        entry = _STORES[key] = [rendezvous.connect(e.master_addr, e.master_port, e.rank, e.world_size, timeout), 0]
    else:
        entry[0].set_timeout(timedelta(seconds=timeout))
    entry[1] += 1
    return PrefixStore(f"init{entry[1]}", entry[0])


_ELASTIC = {"store": None, "generation": -1, "members": {}, "port": None}   # kept across pt.destroy()
_ELASTIC_LOCK = threading.Lock()   # the members, between the main thread and the heartbeat's


def _elastic_world(e, worker_id, timeout):
    """An elastic job's rank and world size come from the launcher's rendezvous
    (elastic_rendezvous.py), not from the environment, and the store is the
    launcher's (it outlives any worker); each generation's set-up goes under its
    own key prefix. The local rank is the rank among the members on this host."""
    from . import elastic_rendezvous
    client = _ELASTIC["store"]
    if client is None:
        client = _ELASTIC["store"] = rendezvous.connect_client(e.master_addr, e.master_port, timeout)
        _ELASTIC["port"] = e.master_port
        beat_s = config.get("PARATRAIN_ELASTIC_HEARTBEAT") / 5   # several beats in the launcher's limit
        _ELASTIC["declared"] = elastic_rendezvous.Lines(elastic_rendezvous.KEY_DECLARED)
        elastic_rendezvous.Heartbeat(lambda: rendezvous.connect_client(e.master_addr, e.master_port, timeout),
                                     worker_id, beat_s, _watch_world)
    host = envmod.host_id()
    g, ranks, hosts = elastic_rendezvous.join(client, worker_id, _ELASTIC["generation"],
                                              config.get("PARATRAIN_ELASTIC_TIMEOUT"), host)
    with _ELASTIC_LOCK:
        _ELASTIC["generation"], _ELASTIC["members"] = g, ranks
        abandon.clear()   # a new world: whatever the last one was given up for is behind
    rank, world_size = ranks[str(worker_id)], len(ranks)
    here = sorted(r for w, r in ranks.items() if hosts.get(w, host) == host)
    for name, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("LOCAL_RANK", here.index(rank)),
                        ("LOCAL_WORLD_SIZE", len(here))):
        os.environ[name] = str(value)   # what a script reading the environment expects
    client.set_timeout(timedelta(seconds=timeout))
    e = dataclasses.replace(e, rank=rank, world_size=world_size, local_rank=here.index(rank),
                            local_world_size=len(here))
    return e, PrefixStore(f"gen{g}", client)


def _watch_world(store):
    """The heartbeat thread, every tenth of a second: is this worker's world gone? A worker
    in it was declared dead by the launcher (it stopped beating: its sockets may never
    close, and the waits for it would last until the timeout), or a peer found it broken
    (in a mesh, a rank may wait for a peer that left it, alive). Then it is given up on
    here too (abandon.py)."""
    from . import elastic_rendezvous as keys
    for record in _ELASTIC["declared"].new(store):
        with _ELASTIC_LOCK:
            rank = _ELASTIC["members"].get(str(record["id"]))
            if rank is not None:
                abandon.abandon(f"worker {record['id']} (rank {rank}) was declared dead by the launcher: "
                                f"{record['why']}", keep_port=_ELASTIC["port"])
    g = _ELASTIC["generation"]
    if abandon.reason() is None and g >= 0 and store.check([keys.key_broken(g)]):
        why = store.get(keys.key_broken(g)).decode()
        with _ELASTIC_LOCK:
            if _ELASTIC["generation"] == g and abandon.reason() is None:
                abandon.abandon(f"a peer gave up on this world: {why}", keep_port=_ELASTIC["port"])


def elastic_world_broken(why):
    """This worker's world failed (pt.elastic.run caught the error): its peers are told,
    and give up on it too (_watch_world)."""
    from . import elastic_rendezvous as keys
    if _ELASTIC["store"] is not None and _ELASTIC["generation"] >= 0:
        _ELASTIC["store"].set(keys.key_broken(_ELASTIC["generation"]), why)


def elastic_generation():
    """(the launcher's store, this world's generation) in an elastic job, else (None, None)."""
    if _ELASTIC["store"] is None or _S.world is None:
        return None, None
    return _ELASTIC["store"], _ELASTIC["generation"]


def _processes(store, rank, world_size, timeout):
    """(real host, pid) of every rank, in one exchange through the store: the host
    layout (_host_layout), and how a rank whose peer's connection broke checks
    whether that peer died (liveness.py), and says so by rank."""
    said = rendezvous.exchange(store, "proc", rank, world_size, f"{envmod.host_id()} {os.getpid()}", timeout,
                               "the exchange of hosts and pids")
    out = []
    for text in said:
        host, _, pid = text.rpartition(" ")
        out.append((host, int(pid) if pid.isdigit() else 0))
    return out


def _host_layout(names):
    """Host index of every rank, from the ranks' host names, or k pretend hosts."""
    world_size = len(names)
    k = envmod.pretend_hosts()
    if k:
        if not 1 <= k <= world_size:
            raise ValueError(f"PARATRAIN_PRETEND_HOSTS={k} must be between 1 and the world size {world_size}")
        return [r * k // world_size for r in range(world_size)]
    index = {}
    return [index.setdefault(n, len(index)) for n in names]


def _init_torch(backend, timeout):
    import torch.distributed as dist
    if not _S.torch_initialized:
        bind_world_defaults_early()
        engine = "nccl" if backend == "nccl" else "gloo"
        try:
            dist.init_process_group(engine, store=_prefix("torch"), rank=_S.env.rank,
                                    world_size=_S.env.world_size, timeout=timedelta(seconds=timeout))
        except RuntimeError as e:   # DistStoreError (a wait timed out), a peer's connection failed
            raise _setup_error(f"torch.distributed's set-up of {engine}", timeout, e) from None
        _S.torch_initialized = True
        atexit.register(_destroy_at_exit)


def _setup_error(what, timeout, e):
    """A rank came to the rendezvous, then did not get through the engine's set-up."""
    me = _S.env.rank
    others = [r for r in range(_S.env.world_size) if r != me]
    dead = dead_local_peers(_S.procs, me, others)
    who = (f"ranks {dead} exited after the rendezvous" if dead else
           "a rank died, exited or got stuck after the rendezvous (its own output says why)")
    return rendezvous.RendezvousError(f"rank {me}: {what} did not complete within {timeout:g}s: {who} "
                                      f"({first_line(e)})")


def bind_world_defaults_early():
    """Import torch modules that take ``group.WORLD`` as a default argument before
    the process group exists, so their defaults hold None rather than the group.

    torch.distributed.nn.functional writes ``group=group.WORLD`` in its
    signatures, and Python evaluates a default once, at import. Imported after
    init_process_group (torch._dynamo imports it, and the first torch.optim
    optimizer imports torch._dynamo), it holds ten references to the default
    group, so destroy_process_group() cannot free it: Gloo's threads
    (pt_gloo_runloop, gloo_tcp_loop) live on into interpreter finalization,
    and the process may abort there with "terminate called without an active
    exception" after the job's work is done (pytorch/pytorch#179291 describes
    how a Gloo thread releasing a tensor then needs a GIL that is gone).
    It is a small module, so importing it early costs nothing.
    torch.distributed.optim's ZeroRedundancyOptimizer and FSDP's
    ShardedGradScaler take the same default; import them before pt.init() if
    you use them."""
    importlib.import_module("torch.distributed.nn.functional")  # for its import-time defaults


def _destroy_at_exit():
    """Release torch.distributed's process group before the interpreter tears down.

    A Gloo process group still alive when the interpreter finalizes can be
    destroyed after the C++ runtime it needs, and the process then dies with
    "terminate called without an active exception" (SIGABRT) after the job's
    work is done (a script that all-reduced and returned without pt.destroy(),
    under load). torch asks scripts to call destroy_process_group() before
    exiting; this does it for those that do not (atexit runs after the
    non-daemon threads, such as our async lanes, have been joined, and before
    finalization)."""
    if _S.torch_initialized:
        try:
            destroy()
        except Exception as e:   # (exiting anyway: say why, but do not mask the exit status)
            print(f"paratrain: releasing torch.distributed at exit failed: {e}", file=sys.stderr)


def _prefix(name):
    return PrefixStore(name, _S.store)


def _make_group(ranks, global_rank, backend, timeout, world=False):
    """Build a group over ``ranks`` (global ranks, all callers pass the same list).
    Returns None on ranks outside the group, as torch.distributed does."""
    _S.group_count += 1
    key = f"g{_S.group_count}"
    member = global_rank in ranks
    group = _build_group(ranks, global_rank, backend, timeout, world, key, member)
    if group is not None:   # its name in a trace: the same on every member
        group.trace_name = "world" if world else f"{key}[{','.join(map(str, ranks))}]"
    return group


def _build_group(ranks, global_rank, backend, timeout, world, key, member):
    if backend in ("torch", "gloo", "nccl"):
        import torch.distributed as dist
        from .torch_backend import TorchGroup
        _init_torch(backend, timeout)
        pg = None if world else dist.new_group(ranks, timeout=timedelta(seconds=timeout))
        return TorchGroup(ranks.index(global_rank), len(ranks), ranks, pg, timeout, _S.procs) if member else None
    if backend == "shm":
        from .shm.group import ShmGroup
        return ShmGroup(_S.store, key, ranks.index(global_rank), ranks, timeout) if member else None
    if backend == "hierarchical":
        from .hierarchical import HierarchicalGroup
        return HierarchicalGroup.build(ranks, global_rank, _S.hosts, _S.store, key, timeout, _make_group)
    raise ValueError(f"backend {backend!r} cannot make sub-groups here")


def world():
    """The group of all ranks (call pt.init() first)."""
    if _S.world is None:
        raise CommError("paratrain is not initialized: call pt.init() first")
    return _S.world


def world_backend():
    """The backend the world was made with ("shm", "torch", ...; None before pt.init())."""
    return _S.backend if _S.world is not None else None


def new_group(ranks, backend=None):
    """A group over a subset of ranks. Every rank must call it, with the same list,
    in the same order relative to other new_group calls (as with torch.distributed).
    Returns the group on members and None elsewhere."""
    w = world()
    ranks = sorted(int(r) for r in ranks)
    if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= w.world_size:
        raise ValueError(f"new_group ranks {ranks} must be distinct ranks of the world (0..{w.world_size - 1})")
    backend = backend or _S.backend
    if backend == "mpi":
        from .mpi_backend import mpi_new_group
        return _remember(mpi_new_group(w, ranks))
    if backend == "hierarchical" and len({_S.hosts[r] for r in ranks}) == 1:
        backend = "shm"
    return _remember(_make_group(ranks, _S.env.rank, backend, w.timeout))


def _remember(group):
    if group is not None:
        _S.groups += (group,)
    return group


def destroy():
    """Leave the job: release threads, and mark the world and every sub-group destroyed,
    so a later call on one of them raises (segments are unlinked already, and go
    with the process). The rendezvous store stays connected, for a later
    pt.init() (_job_store)."""
    global _S
    if _S.watchdog is not None:
        _S.watchdog.stop()
    for g in _S.groups:
        g.destroy()
    if _S.world is not None:
        _S.world.destroy()
    if _S.torch_initialized:
        import torch.distributed as dist
        dist.destroy_process_group()
    _S = _State()
