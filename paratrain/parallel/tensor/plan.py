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

With ``sequence_parallel=True`` (Korthikanti et al., arXiv 2205.05198) the
activations between a rowwise and the next colwise layer are cut along the
sequence (dimension ``sequence_dim``, 1 for (B, T, d)): each rank runs the
LayerNorms and the residual on T/p tokens, a colwise layer all-gathers its
input along the sequence and a rowwise layer reduce-scatters its output
along it. Three more values say where that region lies; without
``sequence_parallel`` they do nothing, so one plan serves both ways:

- ``"split_input"`` (any module): its first input is cut along the sequence
  before it runs: where the region starts (the first block);
- ``"sequence"`` (any module): it runs on a sequence shard with whole
  parameters (a LayerNorm, as torch's ``SequenceParallel`` style), so their
  gradients are summed over the group;
- ``"gather_output"`` (any module): its output is gathered along the sequence:
  where the region ends (``"sequence+gather_output"`` for the final norm).

Values join with ``+``.

Each module keeps its own weights: this rank's slice of them replaces it, so a
model built from a seed and then parallelized equals the one-process model
built from that seed. Whatever sits between a colwise and a rowwise layer
must work on the last dimension's shard as on the whole (an activation, or
attention reading its head count from its input's width, as the built-in
GPT does). Modules the plan does not name stay replicated.
"""
import re

from torch import nn

from .layers import ColumnParallelLinear, RowParallelLinear, _divisible
from .vocab import VocabParallelEmbedding

GPT_PLAN = {
    "tok_emb": "vocab",
    "blocks.0": "split_input",           # the sequence-parallel region (sequence_parallel=True) starts here
    "blocks.*.ln1": "sequence",
    "blocks.*.attn.qkv": "colwise:3",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.ln2": "sequence",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
    "ln_f": "sequence+gather_output",    # ... and ends here, before the head
}
LAYER_STYLES = ("colwise", "rowwise", "vocab")
SEQUENCE_STYLES = ("split_input", "sequence", "gather_output")


def _pattern(key):
    return re.compile("^" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")) + "$")


def _styles(value, key):
    """[(kind, parts)] of a plan value such as 'colwise:3' or 'sequence+gather_output'."""
    out = []
    for one in str(value).split("+"):
        kind, _, parts = one.partition(":")
        if kind not in LAYER_STYLES + SEQUENCE_STYLES or (
                parts and (kind != "colwise" or not parts.isdigit() or int(parts) < 1)):
            raise ValueError(f"parallelize: plan[{key!r}] = {value!r}; use 'colwise', 'colwise:k' (k stacked "
                             "parts), 'rowwise', 'vocab', or 'split_input', 'sequence', 'gather_output' "
                             "(joined by '+')")
        out.append((kind, int(parts or 1)))
    if sum(kind in LAYER_STYLES for kind, _ in out) > 1:
        raise ValueError(f"parallelize: plan[{key!r}] = {value!r} cuts one layer two ways; choose one of "
                         "colwise, rowwise, vocab")
    return out


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


def _choose(model, plan, strict=True):
    """{module name: [(kind, parts)]}, every key matched (unless not strict) and every
    kind on a module it fits."""
    names = [name for name, _ in model.named_modules() if name]
    chosen = {}
    for key, value in plan.items():
        styles = _styles(value, key)
        matched = [n for n in names if _pattern(key).match(n)]
        if not matched and strict:
            raise ValueError(f"parallelize: plan key {key!r} names no module of {type(model).__name__} "
                             f"(its modules include: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''})")
        for name in matched:
            if name in chosen:
                raise ValueError(f"parallelize: {name} is named by two plan keys; join its values with '+' "
                                 "under one key")
            module = model.get_submodule(name)
            for kind, _ in styles:
                wanted = {"vocab": nn.Embedding, "colwise": nn.Linear, "rowwise": nn.Linear}.get(kind)
                if wanted and type(module) is not wanted:
                    raise ValueError(f"parallelize: {name} is a {type(module).__name__}; '{kind}' cuts an "
                                     f"nn.{wanted.__name__}")
            chosen[name] = styles
    return chosen


def check_plan(model, plan, size, strict=True):
    """Raise the ValueError ``parallelize`` would, without a group and without touching
    the model: plan keys, module kinds, and every width, vocabulary and head count
    ``size`` must divide. For a front-end that refuses bad options before starting
    any worker."""
    chosen = _choose(model, plan, strict)
    for name, styles in chosen.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = model.get_submodule(name)
        for kind, parts in styles:
            if kind == "colwise":
                _divisible(module.out_features, size * parts, "out_features", "ColumnParallelLinear")
                _check_heads(parent, name, module, kind, parts, size)
            elif kind == "rowwise":
                _divisible(module.in_features, size, "in_features", "RowParallelLinear")
            elif kind == "vocab":
                _divisible(module.num_embeddings, size, "num_embeddings", "VocabParallelEmbedding")
    return chosen


def _sequence_region(model, name, kinds, group, dim):
    """The hooks of 'split_input', 'sequence' and 'gather_output' on module ``name``."""
    from . import functional as tpf
    module = model.get_submodule(name)
    if "split_input" in kinds:
        module.register_forward_pre_hook(lambda m, args: (tpf.split(args[0], group, dim=dim), *args[1:]))
    if "sequence" in kinds:
        for param in module.parameters():
            tpf.sum_gradient(param, group)
    if "gather_output" in kinds:
        module.register_forward_hook(lambda m, args, out: tpf.all_gather(out, group, dim=dim))


def parallelize(model, group=None, plan=None, sequence_parallel=False, sequence_dim=1, strict=True):
    """Shard ``model``'s modules named by ``plan`` across ``group``, in place; returns
    ``model``. Every rank must call it alike. ``sequence_parallel``: see above.
    ``strict=False`` lets plan keys name no module (a part of a model, which holds
    only some of the layers the plan names)."""
    from ...comm import world
    group = group or world()
    if not plan:
        raise ValueError("parallelize: give a plan, {module path: 'colwise' | 'colwise:k' | 'rowwise' | 'vocab'}")
    chosen = check_plan(model, plan, group.world_size, strict)
    if sequence_parallel and not any(kind == "split_input" for styles in chosen.values() for kind, _ in styles):
        raise ValueError("parallelize: sequence_parallel=True, but the plan names no module as 'split_input' "
                         "(where the sequence is first cut) nor 'gather_output' (where it is gathered again); "
                         "add them, as pt.tensor.GPT_PLAN does")
    sp = dict(sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
    for name, styles in chosen.items():
        kinds = [kind for kind, _ in styles]
        if sequence_parallel:
            _sequence_region(model, name, kinds, group, sequence_dim)
        for kind, parts in styles:
            if kind not in LAYER_STYLES:
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            _check_heads(parent, name, model.get_submodule(name), kind, parts, group.world_size)
            old = getattr(parent, attr)
            if kind == "colwise":
                new = ColumnParallelLinear.from_linear(old, group, parts=parts, **sp)
            elif kind == "rowwise":
                new = RowParallelLinear.from_linear(old, group, **sp)
            else:
                new = VocabParallelEmbedding.from_embedding(old, group)
            setattr(parent, attr, new)
    return model
