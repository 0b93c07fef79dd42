"""The Gloo process group that the benchmarks' torch engines (DDP, FSDP, torch's
pipeline and tensor parallelism) run on, beside paratrain's own group in the
same worker: started once per process, and torn down in the one order that
neither hangs nor aborts."""
import gc
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from ..comm.world import bind_world_defaults_early


def init_gloo(group, timeout, addr="127.0.0.1"):
    """torch.distributed over Gloo beside paratrain's group, once per process (the
    competitor engines of the benchmarks)."""
    if not dist.is_initialized():
        bind_world_defaults_early()   # else the group outlives destroy_process_group() (world.py)
        dist.init_process_group("gloo", store=store_beside(group, timeout, addr), rank=group.rank,
                                world_size=group.world_size, timeout=timedelta(seconds=timeout))


def store_beside(group, timeout, addr="127.0.0.1"):
    """A TCPStore for torch.distributed's rendezvous among ``group``'s ranks, on a port
    rank 0's system chose as it bound it, sent to the others over ``group``. A port
    picked in advance may be taken by another process (an outgoing connection of a job
    beside this one) before rank 0 binds it: EADDRINUSE, and the other ranks would wait
    out their timeout."""
    wait = timedelta(seconds=timeout)
    port = np.zeros(1, dtype=np.int64)
    if group.rank == 0:
        store = dist.TCPStore(addr, 0, group.world_size, is_master=True, timeout=wait, wait_for_workers=False)
        port[0] = store.port
    group.broadcast(port, src=0)
    if group.rank != 0:
        store = dist.TCPStore(addr, int(port[0]), group.world_size, is_master=False, timeout=wait)
    return store


def release_ddp(engines):
    """Free DDP before its Gloo group, then the group, while the interpreter is whole.

    The other orders hang or abort: a group left to the interpreter's exit may
    abort the process ("terminate called without an active exception"), and a
    group whose last reference is DDP's reducer is destroyed when the reducer is
    freed, with the GIL held, joining a Gloo thread that waits for the GIL to
    drop a Python object: a deadlock (destroy_process_group() before the models
    are freed does that)."""
    engines.clear()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
