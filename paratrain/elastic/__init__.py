"""pt.elastic: training that goes on when workers die or join.

    sampler = pt.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    state = pt.elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)

run.py: @pt.elastic.run, the training function called again in a new world.
sampler.py: every sample of an epoch used exactly once across changes of
the world's size. state.py: the commit in memory, and one rank's commit
sent to every rank. rebuilt.py: a mesh's model, built again in each world.
"""
from .rebuilt import Rebuilt, Replica
from .run import WorldChanged, run
from .sampler import ElasticSampler
from .state import State

__all__ = ["ElasticSampler", "Rebuilt", "Replica", "State", "WorldChanged", "run"]
