"""``--optimizer``: the optimizer a worker steps, the same for every strategy.

Every strategy that steps an optimizer in the worker (allreduce, pipeline,
ZeRO) builds it here, and the parameter server asks its servers for the same
one with the same hyper-parameters, so a run compared across strategies
differs in how it communicates, not in what it optimizes.

The workers step torch's fused optimizers (``fused=True``: one kernel walks
each tensor once for the whole update) rather than its default chain of
foreach operations, each a pass over every parameter. Besides the passes
saved, the chain's square root of Adam's second moment takes a slow path in
torch's CPU kernel wherever that moment is exactly zero: every entry that a
compressed gradient (top-k) has not yet selected. The fused kernel has no
such path. SGD's fused update is the same arithmetic bit for bit; Adam's
rounds differently in the last place.
"""
import torch

OPTIMIZERS = ("sgd", "adam")
SGD_MOMENTUM = 0.9   # --optimizer sgd is SGD with this momentum, in the workers and on the servers alike
FUSED = {"fused": True}   # how the workers' torch optimizers run (above); the servers have their own


def add_options(parser):
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="default: the task's")


def optimizer_class(name, lr, momentum=SGD_MOMENTUM):
    """(torch.optim class, its keyword arguments besides the parameters): for a strategy
    that builds the optimizer itself (ZeRO, over its own shards), or names it to servers."""
    if name == "sgd":
        return torch.optim.SGD, dict(lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam, dict(lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose sgd or adam")


def make_optimizer(name, params, lr, momentum=SGD_MOMENTUM):
    cls, kwargs = optimizer_class(name, lr, momentum)
    return cls(params, **kwargs, **FUSED)
