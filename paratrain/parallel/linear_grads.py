"""Linear layers' weight gradients written straight into DataParallel's buckets.

Autograd computes a linear layer's weight gradient g^T x into a fresh tensor,
and DataParallel then copies it into its bucket (buckets.py, ``adopt_grad``):
for the 21M-parameter MLP that copy reads and writes 84 MB a step, as much
memory traffic as the averaging itself, on a machine where two workers
already share the memory bandwidth. DDP pays the same copy (and its
``gradient_as_bucket_view`` only moves it: autograd still allocates).

While DataParallel's forward runs, a TorchFunctionMode catches
``F.linear(x, weight, bias)`` on parameters that live in its buckets (every
``nn.Linear``, and any module calling ``F.linear``) and runs it as
``IntoBuckets``: the same forward, and a backward that computes the same
products autograd would (g W for the input, g^T x for the weight, g summed
over the batch for the bias) with the weight's and bias's written by
``torch.mm(..., out=)`` into the bucket view itself, or added to it when the
gradient already holds something (no_sync, or buckets zeroed in place).
The weight's ``.grad`` is the bucket view, as after ``adopt_grad``.

Only where DataParallel averages its buckets after backward (``overlap`` off,
the shm engine on a small machine): there it does not matter when during
backward a gradient is complete, so a weight used twice in one forward
simply gets both contributions added. Parameters with hooks of their own
(``register_hook``) keep autograd's path, so their hooks run.
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode


class IntoBuckets(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, sink):
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.bias = sink, bias
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
        ctx.sink(weight, lambda out: torch.mm(g2.t(), x2, out=out), lambda: g2.t().mm(x2))
        if ctx.bias is not None:
            ctx.sink(ctx.bias, lambda out: torch.sum(g2, 0, out=out), lambda: g2.sum(0))
        return grad_x, None, None, None


class LinearGradsIntoBuckets(TorchFunctionMode):
    """Active during DataParallel's forward: F.linear on bucketed parameters runs as IntoBuckets.

    ``bucketed``: the parameters that live in a bucket; ``sink(p, into, fresh)``: put p's
    gradient in place, by ``into(view)`` or by adding ``fresh()``, then mark p ready."""

    def __init__(self, bucketed, sink):
        super().__init__()
        self.bucketed, self.sink = bucketed, sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(*args, **kwargs)
            if self._takes(x, weight, bias):
                return IntoBuckets.apply(x, weight, bias, self.sink)
        return func(*args, **kwargs)

    def _takes(self, x, weight, bias):
        return (torch.is_grad_enabled() and self._ours(weight) and (bias is None or self._ours(bias))
                and isinstance(x, torch.Tensor) and x.dtype == weight.dtype and x.dim() >= 1)

    def _ours(self, p):
        return (isinstance(p, torch.Tensor) and p.requires_grad and p in self.bucketed
                and not p._backward_hooks)


def _linear_args(input, weight, bias=None):
    return input, weight, bias
