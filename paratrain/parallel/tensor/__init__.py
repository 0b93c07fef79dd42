"""Tensor parallelism: layers cut inside, across a group (issue 26, in progress).

    import paratrain as pt
    h = pt.tensor.ColumnParallelLinear(512, 2048, group=g)(x)      # layers.py
    y = pt.tensor.RowParallelLinear(2048, 512, group=g)(F.gelu(h))
    pt.functional.all_reduce(t, g)                                # functional.py: differentiable collectives
"""
from . import functional
from .layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "functional"]
