"""How ZeRO lays a model's parameters out in shards.

A *unit* is a run of parameters handled together: under stage 3 a module
(``layer_units``: each transformer block, and the root holding the rest, as
units.py chooses them), gathered around its forward and backward; under
stages 1 and 2 a bucket of up to 25 MB (``bucket_units``), so a step costs
few, large collectives. A unit's parameters are packed one after the other in
a flat buffer, padded to a multiple of the world size W, and cut into W equal
chunks: rank r owns chunk r of every unit. So each unit's collectives
(reduce-scatter of its gradients, all-gather of its parameters) are equal
pieces on every rank, the padding is under W elements a unit, and the
optimizer's shard of a rank is its chunks, one per unit.

A parameter reached under two names (tied weights) is one tensor: it is in
one unit under its first name, and autograd sums both uses into its one
``.grad``.
"""
from dataclasses import dataclass, field

import torch

from .units import assign, choose, warn_if_lopsided


@dataclass
class Unit:
    name: str
    module: torch.nn.Module           # the module gathered around its forward (stage 3), or None (a bucket)
    params: list                      # [(name, nn.Parameter)] in the model's order
    world: int
    offsets: list = field(default_factory=list)

    def __post_init__(self):
        at = 0
        for _, p in self.params:
            self.offsets.append(at)
            at += p.numel()
        self.numel = at
        self.chunk = -(-at // self.world)            # ceil: each rank's piece
        self.padded = self.chunk * self.world

    def flat_of(self, tensors, out=None):
        """The unit's tensors (one per parameter, or None for zeros) packed in one padded buffer."""
        dtype = self.params[0][1].dtype
        out = torch.zeros(self.padded, dtype=dtype) if out is None else out.zero_()
        for (_, p), at, t in zip(self.params, self.offsets, tensors):
            if t is not None:
                out[at:at + p.numel()].copy_(t.reshape(-1))
        return out

    def views(self, flat):
        """Each parameter's shape, viewing ``flat``."""
        return [flat[at:at + p.numel()].view_as(p) for (_, p), at in zip(self.params, self.offsets)]


def _trainable(module, recurse):
    return [(n, q) for n, q in module.named_parameters(recurse=recurse) if q.requires_grad]


def layer_units(model, world, units=None):
    """Stage 3's units: the modules units.py chooses (the model's repeated blocks, or
    ``units=``), and the root owning the rest; each tied parameter in one unit."""
    owned = assign(model, choose(model, units))
    warn_if_lopsided(model, owned)
    return _nonempty([Unit(name, module, params, world) for name, module, params in owned])


def parameter_names(model):
    """{id(parameter): every name it has in the model's state dict}: a tied one has several."""
    names = {}
    for name, q in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(q), []).append(name)
    return names


def bucket_units(model, world, bucket_bytes):
    """Stages 1 and 2's units: buckets of consecutive parameters of at most
    ``bucket_bytes`` (a larger parameter alone), filled from the model's last
    parameter back, the order backward produces their gradients, and returned in
    the model's order. Fewer, larger collectives than per layer: nothing needs a
    layer's parameters gathered at a time of its own."""
    named = _trainable(model, recurse=True)   # a tied parameter once
    buckets, current, size = [], [], 0
    for name, q in reversed(named):
        nbytes = q.numel() * q.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, q))
        size += nbytes
    if current:
        buckets.append(current)
    units = [Unit(f"bucket {len(buckets) - 1 - i} ({b[-1][0]}..{b[0][0]})", None, list(reversed(b)), world)
             for i, b in enumerate(buckets)]
    return _nonempty(list(reversed(units)))


def _nonempty(units):
    if not units:
        raise ValueError("ZeRO: the model has no parameters that require gradients")
    return units
