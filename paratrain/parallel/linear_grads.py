"""Linear layers' weight gradients put where they belong, by the products themselves.

Autograd computes a linear layer's weight gradient g^T x into a fresh tensor
and then either keeps it as ``.grad`` or adds it to what ``.grad`` holds.
DataParallel would then copy it into its bucket (buckets.py, ``adopt_grad``):
every gradient read and written once more each step, as much memory traffic
as the averaging itself, where the workers of a host share the memory
bandwidth (DDP pays the same copy).

While DataParallel's forward runs, ``LinearsWithOwnGrads`` has each of its
``nn.Linear`` modules whose parameters all live in buckets (and whose weight
has at least ``LINEAR_GRADS_MIN_NUMEL`` entries) run as
``LinearWithOwnGrads``: the same forward, and a backward that computes the
same products autograd would (g W for the input, g^T x for the weight, g
summed over the rows for the bias) and hands the weight's and bias's to the
owner's ``sink(param, product)``, which puts them in place:
``product.into(t)`` writes into t (``torch.mm(..., out=)``: the bucket
view), ``product.add_to(t)`` accumulates inside the matrix product
(``addmm_``: the pipeline's split-backward W uses it), ``product.fresh()``
is autograd's own tensor.

A custom Function costs a Python call per linear layer, which pays only where
the layer's gradient is large (``LINEAR_GRADS_MIN_NUMEL``). The pipeline's
1F1B keeps autograd's fresh tensor and add for its micro-batches' gradients:
catching its linear layers with a TorchFunctionMode costs more than the
``addmm_`` saves.

A parameter with hooks of its own (``register_hook``) keeps autograd's path,
so they run. The weight gets no AccumulateGrad, so the owner must do what it
would have (DataParallel marks the gradient ready).
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


class WeightProduct:
    """g^T x: a linear layer's weight gradient, over rows g (outputs) and x (inputs)."""

    def __init__(self, g, x):
        self.g, self.x = g, x

    def into(self, out):
        torch.mm(self.g.t(), self.x, out=out)

    def add_to(self, t):
        t.addmm_(self.g.t(), self.x)

    def fresh(self):
        return self.g.t().mm(self.x)


class BiasProduct:
    """g summed over the rows: a linear layer's bias gradient."""

    def __init__(self, g):
        self.g = g

    def into(self, out):
        torch.sum(self.g, 0, out=out)

    def add_to(self, t):
        t.add_(self.g.sum(0))

    def fresh(self):
        return self.g.sum(0)


# A layer takes this path only if its weight has at least this many entries: its
# gradient's copy (4 MB and more) then costs more than the Function's Python calls.
LINEAR_GRADS_MIN_NUMEL = 1 << 20


class LinearWithOwnGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, sink):
        ctx.save_for_backward(x, weight)
        # the parameters themselves, for the sink: what saved_tensors gives back may be another
        # tensor object (a saved_tensors_hooks pair may detach it), whose .grad is not theirs
        ctx.sink, ctx.weight, ctx.bias = sink, weight, bias
        # F.linear's own products (addmm with a bias, else mm, on the input's rows), into a tensor
        # of our own: F.linear on a 3-d input returns a view, which a custom Function may not
        # hand out (an in-place ReLU after it would be refused)
        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
        rows, rows_out = x.reshape(-1, x.shape[-1]), out.view(-1, weight.shape[0])
        if bias is None:
            torch.mm(rows, weight.t(), out=rows_out)
        else:
            torch.addmm(bias, rows, weight.t(), out=rows_out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = g2.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        ctx.sink(ctx.weight, WeightProduct(g2, x2))
        if ctx.bias is not None:
            ctx.sink(ctx.bias, BiasProduct(g2))
        return grad_x, None, None, None


class LinearsWithOwnGrads:
    """Context manager for an owner's forward: each given nn.Linear runs as
    LinearWithOwnGrads, its weight and bias gradients handed to ``sink(p, product)``.

    It sets the modules' own ``forward`` for the duration and removes it after, so
    nothing of it outlives the forward (a copy or a pickle of the model sees plain
    nn.Linear). A TorchFunctionMode catching every F.linear would put a Python call on
    every torch operation of the forward; here only the linear layers pay a call."""

    def __init__(self, linears, sink):
        self.linears, self.sink = linears, sink

    def __enter__(self):
        for m in self.linears:
            m.forward = _OwnGradsForward(m, self.sink)
        return self

    def __exit__(self, *exc):
        for m in self.linears:
            m.__dict__.pop("forward", None)
        return False


class _OwnGradsForward:
    def __init__(self, module, sink):
        self.module, self.sink = module, sink

    def __call__(self, x):
        m = self.module
        w, b = m.weight, m.bias
        if (torch.is_grad_enabled() and _plain(w) and (b is None or _plain(b)) and isinstance(x, torch.Tensor)
                and x.dtype == w.dtype and x.dim() >= 1):
            return LinearWithOwnGrads.apply(x, w, b, self.sink)
        return F.linear(x, w, b)


def _plain(p):
    """A parameter that takes its gradient here: it wants one and has no hooks of its own."""
    return p.requires_grad and not p._backward_hooks


def accumulate(p, product):
    """p's first gradient as autograd would leave it, every later one added inside its
    matrix product (the pipeline's split-backward W)."""
    if p.grad is None:
        p.grad = product.fresh()
    else:
        product.add_to(p.grad)


