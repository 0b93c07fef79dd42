"""Collectives that autograd can differentiate, for models cut inside their layers.

    y = pt.functional.all_reduce(x, group)          # forward: sum over the group; backward: identity
    x = pt.functional.copy_to_group(x, group)       # forward: identity; backward: sum over the group

The convention is tensor parallelism's (Shoeybi et al., "Megatron-LM", arXiv
1909.08053, sec. 3): every rank of the group computes the *same* loss from
tensors that are either replicated (equal on every rank) or sharded (each
rank holds its piece). A replicated tensor then carries one gradient, the
same on every rank, not one per rank, and each collective's backward is its
conjugate:

| forward | backward | Megatron |
| --- | --- | --- |
| ``all_reduce``: partial sums -> replicated sum | identity | g |
| ``copy_to_group``: replicated -> used by sharded work | all-reduce (sum) of the ranks' gradients | f |
| ``all_gather`` (along ``dim``): shards -> replicated whole | this rank's slice of the gradient | |
| ``all_gather(reduce_grad=True)``: shards -> whole, used by sharded work | reduce-scatter of the gradients | |
| ``reduce_scatter`` (along ``dim``): partial sums -> summed shards | all-gather of the gradients | |
| ``broadcast`` from ``src``: src's tensor -> replicated | the gradient on src, zeros elsewhere | |
| ``split`` (along ``dim``): replicated -> this rank's shard | all-gather of the gradients | |

A column-parallel linear layer is ``copy_to_group`` then a local product; a
row-parallel one is a local product then ``all_reduce``: one all-reduce
forward and one backward per pair of layers (layers.py). Sequence
parallelism replaces them by ``all_gather`` and ``reduce_scatter`` along the
sequence (Korthikanti et al., arXiv 2205.05198).

Every rank must call these in the same order (they are collectives); ``dim``
must divide by the group's size.

``traffic`` counts what this process's collectives here moved (calls and
bytes of the whole tensor each works on: the summed tensor of an all-reduce,
the gathered result of an all-gather, the input of a reduce-scatter), so the
training summary and ``paratrain bench tensor`` can set it beside the
formula: per transformer layer, 2 all-reduces of B x T x d forward and 2
backward; and the seconds the layers were blocked in them, which ``paratrain
train`` counts as waiting, not compute.
"""
import contextlib
import time

import torch

from ...trace import recorder as trace


class Traffic:
    """Calls and bytes per kind of collective, and the seconds spent in them (blocked: the
    layers wait for each), since the last ``reset()``."""

    KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")

    def __init__(self):
        self.reset()
        self.seconds = 0.0   # never reset: a caller takes differences (train's compute less its waits)

    def reset(self):
        self.calls = dict.fromkeys(self.KINDS, 0)
        self.bytes = dict.fromkeys(self.KINDS, 0)

    @contextlib.contextmanager
    def moving(self, kind, tensor):
        """Count a collective of ``kind`` on ``tensor``, and time the block that runs it."""
        self.calls[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0


traffic = Traffic()


def _sum(group, x):
    y = x.detach().clone(memory_format=torch.contiguous_format)
    with traffic.moving("all_reduce", y):
        group.all_reduce(y, op="sum")
    return y


def _gather(group, x, dim):
    x = x.detach().contiguous()
    flat = torch.empty(group.world_size * x.numel(), dtype=x.dtype)
    with traffic.moving("all_gather", flat):
        group.all_gather(flat, x.reshape(-1))
    return torch.cat(list(flat.view(group.world_size, *x.shape)), dim=dim)


def _piece(group, x, dim):
    size = x.shape[dim]
    if size % group.world_size:
        raise ValueError(f"dimension {dim} of size {size} cannot be cut into {group.world_size} equal pieces "
                         f"(the group's size); use a size the group divides")
    return x.chunk(group.world_size, dim=dim)[group.rank]


def _scatter_sum(group, x, dim):
    _piece(group, x, dim)   # a size the group does not divide raises its clear error here
    pieces = [p.contiguous() for p in x.detach().chunk(group.world_size, dim=dim)]
    out = torch.empty_like(pieces[0])
    with traffic.moving("reduce_scatter", x):
        group.reduce_scatter(out, torch.cat([p.reshape(-1) for p in pieces]), op="sum")
    return out


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _sum(group, x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _label(ctx):
    """Keep the forward's trace label (the layer) for the collective its backward runs."""
    ctx.label = trace.current_label() if trace.ON else None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        _label(ctx)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        with trace.label(ctx.label):
            return _sum(ctx.group, g), None


def _slice(group, x, dim):
    return _piece(group, x, dim).contiguous()


class _AlongDim(torch.autograd.Function):
    """A collective along ``dim`` whose backward is another one (the table above):
    all_gather -> slice (or reduce-scatter), split -> all_gather, reduce_scatter ->
    all_gather."""

    @staticmethod
    def forward(ctx, x, group, dim, forward, backward):
        ctx.group, ctx.dim, ctx.backward_op = group, dim, backward
        _label(ctx)
        return forward(group, x, dim)

    @staticmethod
    def backward(ctx, g):
        with trace.label(ctx.label):
            return ctx.backward_op(ctx.group, g, ctx.dim), None, None, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, src):
        ctx.group, ctx.src = group, src
        y = x.detach().clone(memory_format=torch.contiguous_format)
        with traffic.moving("broadcast", y):
            group.broadcast(y, src)
        return y

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.group.rank == ctx.src else torch.zeros_like(g)), None, None


def all_reduce(x, group):
    """Sum of every rank's ``x``, on every rank; backward: identity (Megatron's g)."""
    return _AllReduce.apply(x, group)


def copy_to_group(x, group):
    """``x`` as it is; backward: the sum of every rank's gradient (Megatron's f)."""
    return _CopyToGroup.apply(x, group)


def all_gather(x, group, dim=-1, reduce_grad=False):
    """Every rank's ``x`` concatenated along ``dim``, in rank order; backward: this rank's slice.

    ``reduce_grad=True`` when the whole feeds sharded work, as sequence
    parallelism's gather before a column-parallel layer (Korthikanti et al.,
    arXiv 2205.05198, sec. 4.2.2): each rank's gradient of the whole is then
    only its heads' part, and backward reduce-scatters them (sums, then keeps
    this rank's slice)."""
    return _AlongDim.apply(x, group, dim % x.dim(), _gather, _scatter_sum if reduce_grad else _slice)


def split(x, group, dim=-1):
    """This rank's equal slice of ``x`` along ``dim``; backward: all-gather of the slices' gradients."""
    return _AlongDim.apply(x, group, dim % x.dim(), _slice, _gather)


def reduce_scatter(x, group, dim=-1):
    """Piece ``rank`` (along ``dim``) of the sum of every rank's ``x``; backward: all-gather."""
    return _AlongDim.apply(x, group, dim % x.dim(), _scatter_sum, _gather)


def sum_gradient(param, group):
    """Sum ``param``'s gradient over the group as backward produces it, before it is
    accumulated into ``.grad`` (so a DataParallel above sees the sum). For a
    replicated parameter used on a sequence shard (a LayerNorm under sequence
    parallelism): each rank's gradient covers its tokens only."""
    return param.register_hook(lambda g: _sum(group, g))


def broadcast(x, group, src=0):
    """Rank ``src``'s ``x`` on every rank; backward: the gradient on ``src``, zeros elsewhere."""
    return _Broadcast.apply(x, group, src)
