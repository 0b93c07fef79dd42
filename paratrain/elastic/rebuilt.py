"""pt.elastic for a mesh: a model built again in each new world, one replica at a time.

A data-parallel model moves to a new world in place (``pt.DataParallel.regroup``).
A mesh's model, tensor- or pipeline-parallel inside each data-parallel replica,
holds its groups all through its layers and schedules; after a change of world
it is built again, as a worker that joins builds it, and the commit is loaded
into the new one:

    def build(world):
        mesh = pt.mesh(dp=world.world_size // 2, tp=2)
        net = Net(); pt.tensor.parallelize(net, group=mesh["tp"], plan=PLAN)
        model = pt.DataParallel(net, group=mesh["dp"])
        return pt.elastic.Replica(model, torch.optim.Adam(model.parameters()), group=mesh["dp"])

    replica = pt.elastic.Rebuilt(build)
    state = pt.elastic.State(model=replica, optimizer=replica.optimizer, sampler=sampler, step=0)
    # in the loop: replica.model(x), replica.optimizer.step()

Run it under ``paratrain run --min-workers M --replica-size 2``: the launcher
forms each world of whole replicas, and a worker keeps its place in its
replica (its part of the model) for life, so each worker's commit is of its
own part. A lost worker takes its replica out of the world (torchft's replica
groups). After a change, ``group`` (the ranks that hold the same part, one per
replica) is where each part's state comes from (its first rank, in a replica
that was whole before) and how the sampler deals the data: one share per
replica, by ``group``'s rank and size.
"""
from typing import NamedTuple

from .. import comm


class Replica(NamedTuple):
    """What ``build(world)`` returns: the model, its optimizer, and the group of the ranks
    that hold the same part of the model (one per data-parallel replica)."""
    model: object
    optimizer: object
    group: object


class Rebuilt:
    """pt.elastic.State's model for a mesh: ``build(world)`` (a Replica) is called now, or
    ``first`` taken as built, and again in every new world (``regroup``)."""

    def __init__(self, build, first=None):
        self.build = build
        self.current = first if first is not None else build(comm.world())
        self.optimizer = _CurrentOptimizer(self)

    @property
    def model(self):
        return self.current.model

    def regroup(self, world):
        self.current = self.build(world)

    def elastic_group(self):
        """The ranks a commit is synced over, and the data dealt over (run.py)."""
        return self.current.group

    def state_dict(self):
        return self.current.model.state_dict()

    def load_state_dict(self, state):
        self.current.model.load_state_dict(state)


class _CurrentOptimizer:
    """The optimizer of the replica built last: what State commits and restores, and
    what the training loop steps."""

    def __init__(self, rebuilt):
        self._rebuilt = rebuilt

    def __getattr__(self, name):
        return getattr(self._rebuilt.current.optimizer, name)

    def state_dict(self):
        return self._rebuilt.current.optimizer.state_dict()

    def load_state_dict(self, state):
        self._rebuilt.current.optimizer.load_state_dict(state)
