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
- ``"colwise_gather"``: by output features, its output gathered whole along
  the last dimension: a language model's head, whose logits the model's own
  loss reads (torch's ``ColwiseParallel(output_layouts=Replicate())``);
- ``"vocab"``: an ``nn.Embedding`` by rows (VocabParallelEmbedding, vocab.py):
  ids in, replicated rows out.

transformers' ``Conv1D`` (GPT-2) is cut as an ``nn.Linear`` is. An attention
module whose projections are cut by heads then reads this rank's head counts
(heads.py), and a tensor two modules share (tied embeddings) stays one
parameter, cut alike in both (ties.py). ``pt.tensor.plan_for(model)``
(families.py) writes the plan of a GPT-2-, BERT- or Llama-shaped model.

With ``sequence_parallel=True`` (Korthikanti et al., arXiv 2205.05198) the
activations between a rowwise and the next colwise layer are cut along the
sequence (dimension ``sequence_dim``, 1 for (B, T, d)): each rank runs the
LayerNorms and the residual on T/p tokens, a colwise layer all-gathers its
input along the sequence and a rowwise layer reduce-scatters its output
along it. Four more values say where that region lies; without
``sequence_parallel`` they do nothing, so one plan serves both ways:

- ``"split_input"`` (any module): its first input is cut along the sequence
  before it runs: where the region starts (the first block);
- ``"sequence"`` (any module): it runs on a sequence shard with whole
  parameters (a LayerNorm, as torch's ``SequenceParallel`` style), so their
  gradients are summed over the group;
- ``"gather_output"`` (any module): its output is gathered along the sequence:
  where the region ends (``"sequence+gather_output"`` for the final norm);
- ``"gather_input"`` (any module): its first input is gathered along the
  sequence before it runs, and the column layers inside take it as it is
  (their input gradients summed by the gather's reduce-scatter, once): for a
  module that needs every token, as Hugging Face attention, which reads the
  sequence length from its input and takes the mask and rotary positions of
  every token (torch's ``PrepareModuleInput``). A transformers attention
  module cut under sequence parallelism without it is refused.

Values join with ``+``.

A module's first input is its first positional argument, or its ``hidden_states``
keyword; a module's output may be a tuple, whose first element is gathered.

Each module keeps its own weights: this rank's slice of them replaces it, so a
model built from a seed and then parallelized equals the one-process model
built from that seed. Whatever sits between a colwise and a rowwise layer
must work on the last dimension's shard as on the whole (an activation, or
attention reading its head count from its input's width, as the built-in
GPT and transformers' attention do, or from the sizes heads.py divides).
Modules the plan does not name stay replicated.
"""
import re

from torch import nn

from ...trace import recorder as trace
from . import heads, ties
from .layers import ColumnParallelLinear, RowParallelLinear, _divisible, features, is_conv1d
from .vocab import VocabParallelEmbedding, check_embedding

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
LAYER_STYLES = ("colwise", "rowwise", "vocab", "colwise_gather")
SEQUENCE_STYLES = ("split_input", "sequence", "gather_output", "gather_input")


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
                             "parts), 'colwise_gather', 'rowwise', 'vocab', or 'split_input', 'sequence', "
                             "'gather_output', 'gather_input' (joined by '+')")
        out.append((kind, int(parts or 1)))
    if sum(kind in LAYER_STYLES for kind, _ in out) > 1:
        raise ValueError(f"parallelize: plan[{key!r}] = {value!r} cuts one layer two ways; choose one of "
                         "colwise, colwise_gather, rowwise, vocab")
    return out


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
                if kind == "vocab" and type(module) is not nn.Embedding:
                    raise ValueError(f"parallelize: {name} is a {type(module).__name__}; 'vocab' cuts an "
                                     "nn.Embedding")
                if kind in LAYER_STYLES and kind != "vocab" and type(module) is not nn.Linear and not is_conv1d(module):
                    raise ValueError(f"parallelize: {name} is a {type(module).__name__}; '{kind}' cuts an "
                                     "nn.Linear (or transformers' Conv1D)")
            chosen[name] = styles
    return chosen


def check_plan(model, plan, size, strict=True, sequence_parallel=False):
    """Raise the ValueError ``parallelize`` would, without a group and without touching
    the model: plan keys, module kinds, every width, vocabulary and head count
    ``size`` must divide, tied parameters cut alike, and (``sequence_parallel``)
    attention that would see part of the sequence. For a front-end that refuses bad
    options before starting any worker."""
    chosen = _choose(model, plan, strict)
    for name, styles in chosen.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = model.get_submodule(name)
        for kind, parts in styles:
            if kind.startswith("colwise"):
                _divisible(features(module)[1], size * parts, "out_features", "ColumnParallelLinear")
                heads.check_heads(parent, name, features(module)[1], parts, size)
            elif kind == "rowwise":
                _divisible(features(module)[0], size, "in_features", "RowParallelLinear")
            elif kind == "vocab":
                check_embedding(module, size)
    ties.tied_groups(model, chosen)
    if sequence_parallel:
        _check_sequence_parallel(model, chosen)
    return chosen


def _gathered(chosen, name):
    """Whether module ``name`` lies inside a module the plan marks 'gather_input'."""
    return any(kind == "gather_input" and name.startswith(f"{other}.") for other, styles in chosen.items()
               for kind, _ in styles)


def _check_sequence_parallel(model, chosen):
    if not any(kind == "split_input" for styles in chosen.values() for kind, _ in styles):
        raise ValueError("parallelize: sequence_parallel=True, but the plan names no module as 'split_input' "
                         "(where the sequence is first cut) nor 'gather_output' (where it is gathered again); "
                         "add them, as pt.tensor.GPT_PLAN does")
    for name, styles in chosen.items():
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        if (any(kind == "colwise" for kind, _ in styles) and heads.head_dim_of(parent)
                and type(parent).__module__.startswith("transformers") and not _gathered(chosen, name)):
            raise ValueError(f"parallelize: sequence_parallel=True, but {name} lies in {type(parent).__name__}, "
                             "whose forward reads the sequence length from its input (hidden_states.shape) and "
                             "takes the attention mask and rotary positions of every token: it would see "
                             f"1/p of them. Mark {parent_name!r} 'gather_input' so it sees them all "
                             "(pt.tensor.plan_for(model) does)")


def _first_input(args, kwargs, change, name):
    """(args, kwargs) with ``change`` applied to a module's first input."""
    if args:
        return (change(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
    raise ValueError(f"parallelize: {name} was called with no positional input and no hidden_states=, so "
                     "its input cannot be cut or gathered along the sequence; name another module in the plan")


def _first_output(out, change):
    return (change(out[0]), *out[1:]) if isinstance(out, tuple) else change(out)


def _sequence_region(model, name, kinds, group, dim):
    """The hooks of 'split_input', 'sequence', 'gather_output' and 'gather_input' on module ``name``."""
    from . import functional as tpf
    module = model.get_submodule(name)
    if "split_input" in kinds:
        module.register_forward_pre_hook(
            lambda m, args, kwargs: _first_input(args, kwargs, lambda x: tpf.split(x, group, dim=dim), name),
            with_kwargs=True)
    if "gather_input" in kinds:   # every token in; the gradient reduce-scattered once, for every layer inside
        module.register_forward_pre_hook(
            lambda m, args, kwargs: _first_input(
                args, kwargs, lambda x: tpf.all_gather(x, group, dim=dim, reduce_grad=True), name),
            with_kwargs=True)
    if "sequence" in kinds:
        for param in module.parameters():
            tpf.sum_gradient(param, group)
    if "gather_output" in kinds:
        module.register_forward_hook(
            lambda m, args, out: _first_output(out, lambda y: tpf.all_gather(y, group, dim=dim)))


def _label_collectives(module, name):
    """A traced run names the module's collectives after it: forward here, backward
    through the label functional.py's autograd functions keep."""
    outer = []

    def enter(m, args):
        if trace.ON:
            outer.append(trace.current_label())
            trace.set_label(name)

    def leave(m, args, out):
        if outer:
            trace.set_label(outer.pop())
    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)


def _cut(module, kind, parts, group, sequence_parallel, sequence_dim, input_gathered):
    """This rank's layer in place of ``module``, cut as ``kind``."""
    if kind == "colwise":
        return ColumnParallelLinear.from_linear(module, group, parts=parts, sequence_parallel=sequence_parallel,
                                                sequence_dim=sequence_dim, input_gathered=input_gathered)
    if kind == "colwise_gather":   # the head, after the sequence-parallel region: replicated input
        return ColumnParallelLinear.from_linear(module, group, gather_output=True)
    if kind == "rowwise":
        return RowParallelLinear.from_linear(module, group, sequence_parallel=sequence_parallel,
                                             sequence_dim=sequence_dim)
    return VocabParallelEmbedding.from_embedding(module, group)


def parallelize(model, group=None, plan=None, sequence_parallel=False, sequence_dim=1, strict=True):
    """Shard ``model``'s modules named by ``plan`` across ``group``, in place; returns
    ``model``. Every rank must call it alike. ``sequence_parallel``: see above.
    ``strict=False`` lets plan keys name no module (a part of a model, which holds
    only some of the layers the plan names)."""
    from ...comm import world
    group = group or world()
    if not plan:
        raise ValueError("parallelize: give a plan, {module path: 'colwise' | 'colwise:k' | 'rowwise' | 'vocab'}, "
                         "or pt.tensor.plan_for(model)")
    p = group.world_size
    chosen = check_plan(model, plan, p, strict, sequence_parallel)
    tied = ties.tied_groups(model, chosen)
    attention = {}   # attention module name -> the width of each part its cut projections yield
    for name, styles in chosen.items():
        kinds = [kind for kind, _ in styles]
        if sequence_parallel:
            _sequence_region(model, name, kinds, group, sequence_dim)
        for kind, parts in styles:
            if kind not in LAYER_STYLES:
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, attr)
            if kind == "colwise" and heads.head_dim_of(parent):
                attention.setdefault(parent_name, set()).add(features(old)[1] // parts)
            setattr(parent, attr, _cut(old, kind, parts, group, sequence_parallel, sequence_dim,
                                       sequence_parallel and _gathered(chosen, name)))
    ties.retie(model, tied)
    for name in chosen:
        if name:
            _label_collectives(model.get_submodule(name), name)
    for name, widths in attention.items():
        heads.localize(model.get_submodule(name) if name else model, widths, p)
    return model
