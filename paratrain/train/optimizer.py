"""``--optimizer``: the optimizer a worker steps, the same for every strategy.

Every strategy that steps an optimizer in the worker (allreduce, pipeline,
ZeRO) builds it here, and the parameter server asks its servers for the same
one with the same hyper-parameters, so a run compared across strategies
differs in how it communicates, not in what it optimizes.
"""
import torch

OPTIMIZERS = ("sgd", "adam")
SGD_MOMENTUM = 0.9   # --optimizer sgd is SGD with this momentum, in the workers and on the servers alike


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
    return cls(params, **kwargs)
