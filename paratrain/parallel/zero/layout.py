"""How ZeRO lays a model's parameters out in shards.

A *unit* is a module that owns parameters directly (a Linear, an Embedding, a
LayerNorm; the root too if it holds any itself). Its parameters are packed
one after the other in a flat buffer, padded to a multiple of the world size
W, and cut into W equal chunks: rank r owns chunk r of every unit. So each
unit's collectives (reduce-scatter of its gradients, all-gather of its
parameters) are equal pieces on every rank, the padding is under W elements
a unit, and the optimizer's shard of a rank is its chunks, one per unit.

Units are the modules that run a forward of their own, so stage 3 can gather
a unit's parameters just before that forward (and its backward) and free them
after, as FSDP does per wrapped module (Zhao et al., "PyTorch FSDP", arXiv
2304.11277, sec. 3.2); finer units cost more, smaller collectives, and hold
less at once.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class Unit:
    name: str
    module: torch.nn.Module
    params: list                      # [(attribute name, nn.Parameter)] in the module's order
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


def units_of(model, world):
    """Every module owning parameters directly, in registration order; a parameter
    object reached twice (tied weights) is refused: under stage 3 it would live in
    one unit and be needed gathered in another's forward."""
    units, seen = [], {}
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        for n, p in own:
            where = f"{name}.{n}" if name else n
            if id(p) in seen:
                raise ValueError(f"ZeRO: {where} is the same parameter as {seen[id(p)]} (tied weights); "
                                 "ZeRO shards each parameter once: untie them")
            seen[id(p)] = where
        if own:
            units.append(Unit(name or "(root)", module, own, world))
    if not units:
        raise ValueError("ZeRO: the model has no parameters that require gradients")
    return units
