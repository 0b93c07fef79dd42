"""pt.elastic: training that goes on when workers die or join.

    sampler = pt.elastic.ElasticSampler(dataset, shuffle=True, seed=0)

sampler.py: every sample of an epoch used exactly once across changes of
the world's size.
"""
from .sampler import ElasticSampler

__all__ = ["ElasticSampler"]
