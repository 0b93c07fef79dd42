"""pt.elastic.run: call the training function again, in a new world, when the old one fails.

    @pt.elastic.run
    def train(state): ...
    train(state)

Outside an elastic job (no ``paratrain run --min-workers``) the function is
simply called. In one, the world first takes rank 0's starting state (a
worker that joins a running job takes the running one). Then, when a peer
dies in the middle of a collective (``PeerError``, or any ``CommError`` of
a world that broke) or the launcher opens a new generation (a worker was
lost or one joined, seen at ``state.commit()``), every worker:

1. leaves the broken world (pt.destroy()) and joins the next one (pt.init(),
   which asks the launcher for its new rank: comm/elastic_rendezvous.py);
2. moves its DataParallel to the new world (``regroup``; a mesh's model,
   pt.elastic.Rebuilt, is built again there);
3. restores its own last commit, then takes the new rank 0's (``sync``; in a
   mesh, each part's from the first replica's holder of it): a
   survivor that committed one step more or less than the others ends up
   where the new rank 0 is, and a new worker gets everything;
4. deals the rest of the epoch out anew (the sampler), calls the
   ``on_reset`` callbacks, and calls the function again.

A worker that joins a running world calls the ``on_reset`` callbacks too,
after it has the state, as the others do then: a callback may be collective.

As Horovod's ``hvd.elastic.run`` (horovod/common/elastic.py), with the
world formed by the launcher, which outlives any worker, instead of a
driver on rank 0.
"""
import functools
import time

from .. import comm
from ..comm.elastic_rendezvous import ElasticAbort
from ..comm.rendezvous import RendezvousError
from ..comm.world import elastic_generation, elastic_world_broken, world_backend


class WorldChanged(Exception):
    """The launcher opened a new generation: a worker was lost or one joined."""


def run(fn):
    @functools.wraps(fn)
    def wrapper(state, *args, **kwargs):
        store, generation = elastic_generation()
        if store is None:   # not an elastic job: nothing to re-form
            return fn(state, *args, **kwargs)
        why = None   # what broke the last world; None: this one is the first
        while True:
            try:
                if why is None:
                    state.sync(_replica_group(state, comm.world()), root=0)
                    _rebind(state)
                    if generation > 0:   # joined a running world: the others are re-forming
                        state.reset_callbacks()
                else:
                    reform(state, why)
                return fn(state, *args, **kwargs)
            except (ElasticAbort, RendezvousError):
                raise   # the launcher gave up, or is gone: nothing to re-form with
            except (comm.CommError, WorldChanged) as e:
                why = e   # also where the world broke again while re-forming (horovod #2995)
                if isinstance(e, comm.CommError):   # the peers waiting for one another, not the dead, leave too
                    line = str(e).splitlines()[0][:300]
                    elastic_world_broken(f"rank {comm.world().rank}: {line}" if comm.is_initialized() else line)
    return wrapper


def reform(state, why):
    """Steps 1-4 above; notes what happened in ``state.events``."""
    caught_at, t0 = time.time(), time.monotonic()
    old = comm.world().world_size if comm.is_initialized() else None
    backend = world_backend()
    at_step = getattr(state, "step", None)   # before the restore: where this worker was
    comm.destroy()
    world = comm.init(backend=backend)
    model = state.model
    if model is not None and hasattr(model, "regroup"):
        model.regroup(world)
    state.restore()
    state.sync(_replica_group(state, world), root=0)
    _rebind(state)
    step = getattr(state, "step", None)
    state.events.append({"kind": "lost" if isinstance(why, comm.CommError) else "changed",
                         "step": step, "at_step": at_step, "world_size": world.world_size, "was": old,
                         "caught_at": caught_at, "reform_s": time.monotonic() - t0,
                         "why": str(why).splitlines()[0][:200]})
    state.reset_callbacks()
    if world.rank == 0 and state.report:
        print(f"paratrain: elastic: the world is now {world.world_size} workers (was {old}); "
              f"resumed from the commit at step {step} in {time.monotonic() - t0:.2f}s",
              flush=True)


def _replica_group(state, world):
    """Where the commit comes from and the data is dealt: the world, or for a mesh
    (pt.elastic.Rebuilt) the ranks that hold the same part of the model."""
    group = getattr(state.model, "elastic_group", None)
    return group() if group is not None else world


def _rebind(state):
    """The sampler deals the rest of its epoch over the current world (its replicas)."""
    group = _replica_group(state, comm.world())
    if state.sampler is not None and hasattr(state.sampler, "reset"):
        state.sampler.reset(group.rank, group.world_size)
