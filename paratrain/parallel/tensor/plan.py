"""pt.tensor.parallelize: shard the named layers of a user's model in place.

    pt.tensor.parallelize(model, group=g, plan={
        "blocks.*.attn.qkv": "colwise:3",      # a fused q, k, v projection: each part cut by heads
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
    })

As torch's ``parallelize_module``: a key is a module path, ``*`` matching one
level (one name between dots); a value is how that ``nn.Linear`` is cut:

- ``"colwise"``: by output features (ColumnParallelLinear). It takes a
  replicated input and leaves its output sharded along the last dimension;
  ``"colwise:k"`` for an output that stacks k equal parts (q, k and v), each
  cut alike so a rank holds whole heads of each;
- ``"rowwise"``: by input features (RowParallelLinear). It takes a sharded
  input, what a colwise layer leaves, and leaves its output replicated (the
  partial products summed by one all-reduce);
- ``"vocab"``: an ``nn.Embedding`` by rows (VocabParallelEmbedding, vocab.py):
  ids in, replicated rows out.

Each module keeps its own weights: this rank's slice of them replaces it, so a
model built from a seed and then parallelized equals the one-process model
built from that seed. Whatever sits between a colwise and a rowwise layer
must work on the last dimension's shard as on the whole (an activation, or
attention reading its head count from its input's width, as the built-in
GPT does). Modules the plan does not name stay replicated.
"""
import re

from torch import nn

from .layers import ColumnParallelLinear, RowParallelLinear
from .vocab import VocabParallelEmbedding

GPT_PLAN = {
    "tok_emb": "vocab",
    "blocks.*.attn.qkv": "colwise:3",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
}


def _pattern(key):
    return re.compile("^" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")) + "$")


def _style(value, key):
    kind, _, parts = str(value).partition(":")
    if kind not in ("colwise", "rowwise", "vocab") or (
            parts and (kind != "colwise" or not parts.isdigit() or int(parts) < 1)):
        raise ValueError(f"parallelize: plan[{key!r}] = {value!r}; use 'colwise', 'colwise:k' (k stacked parts), "
                         "'rowwise' or 'vocab'")
    return kind, int(parts or 1)


def _check_heads(parent, name, module, kind, parts, p):
    """A fused projection cut by heads (``colwise:k`` inside a module with ``head_dim``,
    as the gpt model's attention) must give every rank whole heads."""
    head_dim = getattr(parent, "head_dim", None)
    if kind != "colwise" or parts == 1 or not head_dim:
        return
    heads = module.out_features // parts // head_dim
    if heads % p:
        raise ValueError(f"parallelize: {name} feeds {heads} attention heads, which cannot be cut into {p} "
                         f"equal groups (the tensor-parallel size); use a head count {p} divides")


def parallelize(model, group=None, plan=None):
    """Shard ``model``'s modules named by ``plan`` across ``group``, in place; returns
    ``model``. Every rank must call it alike."""
    from ...comm import world
    group = group or world()
    if not plan:
        raise ValueError("parallelize: give a plan, {module path: 'colwise' | 'colwise:k' | 'rowwise'}")
    names = [name for name, _ in model.named_modules() if name]
    chosen = {}
    for key, value in plan.items():
        style = _style(value, key)
        matched = [n for n in names if _pattern(key).match(n)]
        if not matched:
            raise ValueError(f"parallelize: plan key {key!r} names no module of {type(model).__name__} "
                             f"(its modules include: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''})")
        for name in matched:
            module = model.get_submodule(name)
            wanted = nn.Embedding if style[0] == "vocab" else nn.Linear
            if type(module) is not wanted:
                raise ValueError(f"parallelize: {name} is a {type(module).__name__}; '{style[0]}' cuts an "
                                 f"nn.{wanted.__name__}")
            chosen[name] = style
    for name, (kind, parts) in chosen.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        _check_heads(parent, name, model.get_submodule(name), kind, parts, group.world_size)
        old = getattr(parent, attr)
        if kind == "colwise":
            new = ColumnParallelLinear.from_linear(old, group, parts=parts)
        elif kind == "rowwise":
            new = RowParallelLinear.from_linear(old, group)
        else:
            new = VocabParallelEmbedding.from_embedding(old, group)
        setattr(parent, attr, new)
    return model
