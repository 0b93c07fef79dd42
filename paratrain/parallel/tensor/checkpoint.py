"""One full model in a checkpoint, whatever the tensor-parallel size that wrote or reads it.

``full_state_dict(model)`` gathers every cut module's weights from its group
into the tensors one process would have (the same names and shapes as the
model before ``parallelize``), on every rank; ``load_full_state_dict(model,
state)`` gives each cut module this rank's slice of them. So a checkpoint
written at TP = 2 loads at TP = 1 (a plain ``load_state_dict``), 2 or 3.
Both are collective over the model's groups: every rank calls them.
"""
import torch

from .functional import _gather
from .layers import ColumnParallelLinear, RowParallelLinear, _rows
from .vocab import VocabParallelEmbedding

CUT = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _whole(module, name, t):
    g, p = module.group, module.group.world_size
    if isinstance(module, ColumnParallelLinear):
        pieces = _gather(g, t, 0).chunk(p)                       # rank order, each its rows of every part
        return torch.cat([torch.cat([piece.chunk(module.parts)[j] for piece in pieces])
                          for j in range(module.parts)])
    if isinstance(module, RowParallelLinear):
        return _gather(g, t, 1) if name == "weight" else t
    return _gather(g, t, 0)


def _slice(module, name, full):
    p, r = module.group.world_size, module.group.rank
    if isinstance(module, ColumnParallelLinear):
        return _rows(full, p, r, module.parts)
    if isinstance(module, RowParallelLinear):
        return full.chunk(p, dim=1)[r].clone() if name == "weight" else full
    return full.chunk(p)[r].clone()


def full_state_dict(model):
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for prefix, module in model.named_modules():
        if isinstance(module, CUT):
            for name, t in module.named_parameters(recurse=False):
                state[f"{prefix}.{name}" if prefix else name] = _whole(module, name, t.detach())
    return state


def load_full_state_dict(model, state):
    local = dict(state)
    for prefix, module in model.named_modules():
        if isinstance(module, CUT):
            for name, _ in module.named_parameters(recurse=False):
                key = f"{prefix}.{name}" if prefix else name
                local[key] = _slice(module, name, state[key])
    model.load_state_dict(local)
