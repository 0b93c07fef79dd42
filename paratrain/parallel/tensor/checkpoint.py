"""One full model in a checkpoint, whatever the tensor-parallel size that wrote or reads it.

``full_state_dict(model)`` gathers every cut module's weights from its group
into the tensors one process would have (the same names and shapes as the
model before ``parallelize``), on every rank; ``load_full_state_dict(model,
state)`` gives each cut module this rank's slice of them. So a checkpoint
written at TP = 2 loads at TP = 1 (a plain ``load_state_dict``), 2 or 3.

``full_optimizer_state(model, opt)`` and ``load_full_optimizer_state(model,
opt, state)`` do the same for an optimizer over ``model.parameters()``: its
per-parameter tensors shaped as the parameter (Adam's two moments, SGD's
momentum) are cut as the parameter is, so the state dict is the one a single
process's optimizer would have and a resumed run continues exactly, at any
tensor-parallel size. All four are collective over the model's groups:
every rank calls them.

A tied parameter (GPT-2's head and embedding, one tensor) is whole under
each of its names, as in ``state_dict()``; a Conv1D's shard keeps its (in,
out) layout, and is gathered whole in it.
"""
import torch

from .functional import _gather
from .layers import ColumnParallelLinear, RowParallelLinear, _rows
from .vocab import VocabParallelEmbedding

CUT = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _whole(module, name, t):
    if name == "weight" and getattr(module, "transposed", False):   # a Conv1D's (in, out): cut as its transpose
        return _whole_rows(module, name, t.t()).t().contiguous()
    return _whole_rows(module, name, t)


def _whole_rows(module, name, t):
    g, p = module.group, module.group.world_size
    if isinstance(module, ColumnParallelLinear):
        pieces = _gather(g, t, 0).chunk(p)                       # rank order, each its rows of every part
        return torch.cat([torch.cat([piece.chunk(module.parts)[j] for piece in pieces])
                          for j in range(module.parts)])
    if isinstance(module, RowParallelLinear):
        return _gather(g, t, 1) if name == "weight" else t
    return _gather(g, t, 0)


def _slice(module, name, full):
    if name == "weight" and getattr(module, "transposed", False):
        return _slice_rows(module, name, full.t()).t().contiguous()
    return _slice_rows(module, name, full)


def _slice_rows(module, name, full):
    p, r = module.group.world_size, module.group.rank
    if isinstance(module, ColumnParallelLinear):
        return _rows(full, p, r, module.parts)
    if isinstance(module, RowParallelLinear):
        return full.chunk(p, dim=1)[r].clone() if name == "weight" else full
    return full.chunk(p)[r].clone()


def _cut_names(model):
    """[(state dict name, cut module, its parameter name)], a tied parameter under each of its names."""
    cut = _cut_parameters(model)
    return [(key, *cut[id(t)]) for key, t in model.named_parameters(remove_duplicate=False) if id(t) in cut]


def full_state_dict(model):
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    whole = {}
    for key, module, name in _cut_names(model):
        held = getattr(module, name)
        if id(held) not in whole:   # a tied parameter is gathered once
            whole[id(held)] = _whole(module, name, held.detach())
        state[key] = whole[id(held)]
    return state


def load_full_state_dict(model, state, strict=True):
    """``strict=False``: ``state`` may hold only some of the model's tensors (a
    pipeline stage's), and only those are loaded."""
    local = dict(state)
    for key, module, name in _cut_names(model):
        if key in state or strict:
            local[key] = _slice(module, name, state[key])
    model.load_state_dict(local, strict=strict)


def _cut_parameters(model):
    """{id(parameter): (cut module, its parameter name)} for the parameters tensor parallelism cut."""
    return {id(t): (module, name) for _, module in model.named_modules() if isinstance(module, CUT)
            for name, t in module.named_parameters(recurse=False)}


def _per_parameter(opt):
    sd = opt.state_dict()
    params = [q for group in opt.param_groups for q in group["params"]]
    return sd, params


def full_optimizer_state(model, opt):
    """``opt.state_dict()`` with every cut parameter's state gathered whole (its own
    tensors are not touched)."""
    sd, params = _per_parameter(opt)
    cut = _cut_parameters(model)
    state = {}
    for i, q in enumerate(params):
        if i not in sd["state"]:
            continue
        state[i] = dict(sd["state"][i])   # a copy: the optimizer's own dict stays as it is
        if id(q) in cut:
            module, name = cut[id(q)]
            for k, v in state[i].items():
                if torch.is_tensor(v) and v.shape == q.shape:
                    state[i][k] = _whole(module, name, v.detach())
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state(model, opt, full):
    """Give ``opt`` this rank's slices of a whole optimizer state (``full_optimizer_state``,
    or a one-process optimizer's ``state_dict()``)."""
    _, params = _per_parameter(opt)
    cut = _cut_parameters(model)
    state = {}
    for i, entries in full["state"].items():
        i = int(i)
        q = params[i]
        state[i] = dict(entries)
        if id(q) in cut:
            module, name = cut[id(q)]
            for k, v in entries.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    state[i][k] = _slice(module, name, v)
    opt.load_state_dict({"state": state, "param_groups": full["param_groups"]})
