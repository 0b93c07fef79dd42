"""Linear layers whose weight is cut across a group (Megatron-LM, arXiv 1909.08053, sec. 3).

- ``ColumnParallelLinear(in, out)``: rank r holds rows r of the weight (a slice
  of the outputs): y_r = x W_r^T + b_r. Its input is replicated; its output is
  sharded along the last dimension (or gathered whole, ``gather_output=True``).
- ``RowParallelLinear(in, out)``: rank r holds columns r of the weight (a
  slice of the inputs): y = sum_r x_r W_r^T, summed by an all-reduce, + b.
  Its input is sharded (``input_is_parallel=True``, what a column layer
  leaves) or replicated and sliced here; its output is replicated.

A column layer followed by a row layer (an MLP, attention's projections)
costs one all-reduce forward (the row layer's) and one backward (the column
layer's input gradient): the conjugate pair f and g (functional.py).

Both start from the weights a single process would have with the same seed:
the whole ``nn.Linear`` is made first, drawing from the generator exactly as
``nn.Linear(in, out)`` does, and this rank keeps its slice. So a tensor-
parallel model and a one-process model built after ``torch.manual_seed(s)``
are the same model.
"""
import torch.nn.functional as F
from torch import nn

from . import functional as tpf


def _size_of(group):
    from ...comm import world
    group = group or world()
    return group, group.world_size, group.rank


def _divisible(n, p, what, layer):
    if n % p:
        raise ValueError(f"{layer}: {what} {n} cannot be cut into {p} equal pieces (the tensor-parallel size); "
                         f"use a size {p} divides")
    return n // p


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, group=None, gather_output=False):
        super().__init__()
        self.group, p, r = _size_of(group)
        self.in_features, self.out_features = in_features, out_features
        per = _divisible(out_features, p, "out_features", "ColumnParallelLinear")
        self.gather_output = gather_output
        full = nn.Linear(in_features, out_features, bias=bias)   # the one-process initialisation
        self.weight = nn.Parameter(full.weight.detach()[r * per:(r + 1) * per].clone())
        self.bias = nn.Parameter(full.bias.detach()[r * per:(r + 1) * per].clone()) if bias else None

    def forward(self, x):
        y = F.linear(tpf.copy_to_group(x, self.group), self.weight, self.bias)
        return tpf.all_gather(y, self.group, dim=-1) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.weight.shape[0]} on this rank), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, group=None, input_is_parallel=True):
        super().__init__()
        self.group, p, r = _size_of(group)
        self.in_features, self.out_features = in_features, out_features
        per = _divisible(in_features, p, "in_features", "RowParallelLinear")
        self.input_is_parallel = input_is_parallel
        full = nn.Linear(in_features, out_features, bias=bias)
        self.weight = nn.Parameter(full.weight.detach()[:, r * per:(r + 1) * per].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if bias else None   # replicated, added once

    def forward(self, x):
        if not self.input_is_parallel:
            x = tpf.split(x, self.group, dim=-1)
        y = tpf.all_reduce(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return (f"in_features={self.in_features} ({self.weight.shape[1]} on this rank), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")
