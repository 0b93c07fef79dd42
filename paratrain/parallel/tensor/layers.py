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

``sequence_parallel=True`` (Korthikanti et al., arXiv 2205.05198, sec. 4.2.2):
outside the pair, activations are cut along the sequence (dimension
``sequence_dim``), so the column layer all-gathers its input along it (and
reduce-scatters the gradient) and the row layer reduce-scatters its output
along it instead of all-reducing: the same bytes, but what lies between
(LayerNorm, dropout, the residual) holds 1/p of the tokens. The row layer's
bias is then added to this rank's tokens only, and its gradient is summed
over the group.

Both also cut transformers' ``Conv1D`` (GPT-2's layers: the weight stored
(in, out) and applied as ``x @ W + b``, Radford et al.): the cut is the same,
taken on the transposed weight, and the shard keeps Conv1D's layout
(``transposed``), so its name and shape match the Hugging Face state dict's.

``input_gathered=True`` (a column layer under sequence parallelism): an
enclosing module already all-gathered the input along the sequence (the
plan's ``"gather_input"``: Hugging Face attention reads the sequence length
from its input, so it must see every token), and that gather's backward
reduce-scatters. The layer then neither gathers nor all-reduces: its input
gradient is left partial, summed with its siblings' (q, k and v) by that one
reduce-scatter, as torch's ``PrepareModuleInput`` before ``ColwiseParallel``.

Both start from the weights a single process would have with the same seed:
the whole ``nn.Linear`` is made first, drawing from the generator exactly as
``nn.Linear(in, out)`` does, and this rank keeps its slice. So a tensor-
parallel model and a one-process model built after ``torch.manual_seed(s)``
are the same model.
"""
import torch
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


def is_conv1d(module):
    """transformers' Conv1D (GPT-2), recognised without importing transformers (optional)."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def features(module):
    """(in_features, out_features) of an nn.Linear or a Conv1D."""
    return (module.nx, module.nf) if is_conv1d(module) else (module.in_features, module.out_features)


def _as_linear(module):
    """(weight as nn.Linear holds it, (out, in); bias; transposed): Conv1D's (in, out) weight turned."""
    if is_conv1d(module):
        return module.weight.detach().t(), module.bias, True
    return module.weight.detach(), module.bias, False


def _rows(t, p, r, parts):
    """Rank r's rows of t (dim 0) when t stacks ``parts`` equal blocks (a fused q, k, v
    projection has 3): each block is cut alike and r's pieces are stacked again."""
    return torch.cat([block.chunk(p, dim=0)[r] for block in t.chunk(parts, dim=0)]).clone()


class ColumnParallelLinear(nn.Module):
    """parts: the output stacks that many equal blocks (a fused q, k, v projection: 3),
    each cut across the group alike, so a rank holds its own heads of each."""

    def __init__(self, in_features, out_features, bias=True, group=None, gather_output=False, parts=1,
                 sequence_parallel=False, sequence_dim=1, input_gathered=False):
        super().__init__()
        full = nn.Linear(in_features, out_features, bias=bias)   # the one-process initialisation
        self._shard(full, group, gather_output, parts, sequence_parallel, sequence_dim, input_gathered)

    @classmethod
    def from_linear(cls, linear, group=None, gather_output=False, parts=1, sequence_parallel=False, sequence_dim=1,
                    input_gathered=False):
        """This rank's share of an existing nn.Linear or Conv1D (its weights, not new ones)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._shard(linear, group, gather_output, parts, sequence_parallel, sequence_dim, input_gathered)
        return layer

    def _shard(self, full, group, gather_output, parts, sequence_parallel, sequence_dim, input_gathered):
        self.group, p, r = _size_of(group)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.input_gathered = input_gathered
        (self.in_features, self.out_features), self.parts = features(full), parts
        _divisible(self.out_features, p * parts, "out_features", "ColumnParallelLinear")
        if gather_output and parts > 1:
            raise ValueError("ColumnParallelLinear: gather_output with parts > 1 would interleave the parts; "
                             "gather each part yourself")
        self.gather_output = gather_output
        weight, bias, self.transposed = _as_linear(full)
        mine = _rows(weight, p, r, parts)
        self.weight = nn.Parameter(mine.t().contiguous() if self.transposed else mine)
        self.bias = nn.Parameter(_rows(bias.detach(), p, r, parts)) if bias is not None else None

    def forward(self, x):
        if self.input_gathered:        # the enclosing module gathered it, and its backward sums the gradient
            pass
        elif self.sequence_parallel:   # this rank's tokens in, every token out
            x = tpf.all_gather(x, self.group, dim=self.sequence_dim, reduce_grad=True)
        else:
            x = tpf.copy_to_group(x, self.group)
        y = F.linear(x, self.weight.t() if self.transposed else self.weight, self.bias)
        return tpf.all_gather(y, self.group, dim=-1) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.weight.shape[int(self.transposed)]} on this rank), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, group=None, input_is_parallel=True,
                 sequence_parallel=False, sequence_dim=1):
        super().__init__()
        self._shard(nn.Linear(in_features, out_features, bias=bias), group, input_is_parallel, sequence_parallel,
                    sequence_dim)

    @classmethod
    def from_linear(cls, linear, group=None, input_is_parallel=True, sequence_parallel=False, sequence_dim=1):
        """This rank's share of an existing nn.Linear or Conv1D (its weights, not new ones)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._shard(linear, group, input_is_parallel, sequence_parallel, sequence_dim)
        return layer

    def _shard(self, full, group, input_is_parallel, sequence_parallel, sequence_dim):
        self.group, p, r = _size_of(group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel takes the input a column-parallel layer leaves "
                             "(input_is_parallel=True)")
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.in_features, self.out_features = features(full)
        per = _divisible(self.in_features, p, "in_features", "RowParallelLinear")
        self.input_is_parallel = input_is_parallel
        weight, bias, self.transposed = _as_linear(full)
        mine = weight[:, r * per:(r + 1) * per]
        self.weight = nn.Parameter(mine.t().contiguous() if self.transposed else mine.clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None   # replicated, added once
        if self.bias is not None and sequence_parallel:
            tpf.sum_gradient(self.bias, self.group)   # added to this rank's tokens only

    def forward(self, x):
        if not self.input_is_parallel:
            x = tpf.split(x, self.group, dim=-1)
        partial = F.linear(x, self.weight.t() if self.transposed else self.weight)
        if self.sequence_parallel:   # summed, and this rank keeps its tokens
            y = tpf.reduce_scatter(partial, self.group, dim=self.sequence_dim)
        else:
            y = tpf.all_reduce(partial, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return (f"in_features={self.in_features} ({self.weight.shape[1 - int(self.transposed)]} on this rank), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")
