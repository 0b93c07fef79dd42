"""The Gloo process group that the benchmarks' torch engines (DDP, FSDP, torch's
pipeline and tensor parallelism) run on, beside paratrain's own group in the
same worker: started once per process, and torn down in the one order that
neither hangs nor aborts."""
import gc
from datetime import timedelta

import torch.distributed as dist

from ..comm.world import bind_world_defaults_early


def init_gloo(group, port, timeout):
    """torch.distributed over Gloo beside paratrain's group, once per process (the
    competitor engines of the benchmarks), on the port after the job's."""
    if not dist.is_initialized():
        bind_world_defaults_early()   # else the group outlives destroy_process_group() (world.py)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + 1}", rank=group.rank,
                                world_size=group.world_size, timeout=timedelta(seconds=timeout))


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
