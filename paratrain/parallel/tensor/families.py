"""pt.tensor.plan_for(model): a transformer's tensor-parallel plan, read from its blocks.

    plan = pt.tensor.plan_for(model)          # GPT-2, BERT, Llama and models built like them
    pt.tensor.parallelize(model, group=g, plan=plan, sequence_parallel=True)

A transformer is a stack of blocks of one class (a ModuleList), each holding
attention and then an MLP. Megatron-LM (arXiv 1909.08053, sec. 3) cuts both
alike: the layers that read the block's input by columns (q, k, v; the MLP's
up and gate), the layer that writes back to it by rows (attention's output,
the MLP's down), so each costs one all-reduce forward. The plan follows from
which layer plays which part, and that is read from the block's structure,
not from the model's class:

- attention: q, k and v as three layers named as a family names them
  (``q_proj``/``k_proj``/``v_proj``: Llama, Mistral, Qwen2; ``query``/``key``/
  ``value``: BERT; ``wq``/``wk``/``wv``; ``q``/``k``/``v``), each ``"colwise"``, or
  fused in one layer whose output is q|k|v in three equal parts (GPT-2's
  ``c_attn``, ``qkv``, ``qkv_proj``, ``Wqkv``), ``"colwise:3"``. k and v may
  be narrower than q (grouped-query attention: cut alike, so the
  tensor-parallel size must divide the key-value heads). The next layer that
  takes q's width is attention's output, ``"rowwise"``;
- the MLP: the layers after it, all but the last reading the block's width
  (``"colwise"``), the last writing it back (``"rowwise"``);
- the input embedding ``"vocab"`` and the output layer over the vocabulary
  ``"colwise_gather"`` (its logits gathered whole for the model's own loss):
  a tied pair is so cut alike, one shard serving both (ties.py).
  ``vocab=False`` leaves both whole, for a vocabulary the group size does
  not divide (GPT-2's 50257);
- sequence parallelism (Korthikanti et al., arXiv 2205.05198): the first
  block ``"split_input"``, the last ``"gather_output"``, each norm in a block
  ``"sequence"``, and attention and the MLP ``"gather_input"``: Hugging Face
  attention reads the sequence length from its input, so it takes every token.

Anything else in a block (a fused q, k, v of unequal or interleaved parts,
parameters inside attention such as per-head norms, experts, blocks that
differ) is not guessed at: plan_for refuses it, saying to pass ``plan=``.
"""
from torch import nn

from .heads import head_dim_of
from .layers import features, is_conv1d
from .vocab import UNSUPPORTED

SEPARATE_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("wq", "wk", "wv"), ("q", "k", "v"))
FUSED_QKV = ("c_attn", "qkv", "qkv_proj", "Wqkv")   # output q | k | v, in this order
QUERY_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")


def _refuse(model, why):
    raise ValueError(f"plan_for: {type(model).__name__}: {why}. No known family has this shape; pass "
                     "plan={module path: style} to pt.tensor.parallelize yourself (its docstring lists the styles)")


def _linear(module):
    return type(module) is nn.Linear or is_conv1d(module)


def _stack(model):
    """(name, ModuleList) of the blocks: the outermost ModuleList of one class whose
    blocks hold linear layers."""
    stacks = []
    for name, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and len(module) and len({type(b) for b in module}) == 1
                and any(_linear(m) for m in module[0].modules())
                and not any(name.startswith(f"{outer}.") for outer, _ in stacks)):
            stacks.append((name, module))
    if len(stacks) != 1:
        _refuse(model, "it has no stack of transformer blocks (a ModuleList of one block class)" if not stacks else
                f"it has {len(stacks)} stacks of blocks ({', '.join(n for n, _ in stacks)}); one is known")
    name, blocks = stacks[0]
    shape = [(n, type(m)) for n, m in blocks[0].named_modules()]
    for i, block in enumerate(blocks):
        if [(n, type(m)) for n, m in block.named_modules()] != shape:
            _refuse(model, f"its blocks differ ({name}.{i} is not built as {name}.0)")
    return name, blocks


def _query_width(attention):
    """The width of q in a fused q|k|v output: GPT-2's split_size, or heads x head_dim."""
    split = getattr(attention, "split_size", None)
    if isinstance(split, int):
        return split
    config = getattr(attention, "config", None)
    for owner, names in ((attention, QUERY_HEADS), (config, ("num_attention_heads",))):
        for name in names:
            heads = getattr(owner, name, None)
            if isinstance(heads, int) and head_dim_of(attention):
                return heads * head_dim_of(attention)
    return None


def _block_plan(model, block):
    """({path in the block: style}, [paths of the modules that take every token]) of one block."""
    layers = [(n, m) for n, m in block.named_modules() if n and _linear(m)]
    plan, attentions, mlp = {}, [], []
    attention, width, i = None, None, 0
    while i < len(layers):
        name, module = layers[i]
        parent, _, leaf = name.rpartition(".")
        three = layers[i:i + 3]
        if (tuple(n.rpartition(".")[2] for n, _ in three) in SEPARATE_QKV
                and len({n.rpartition(".")[0] for n, _ in three}) == 1):
            plan.update((n, "colwise") for n, _ in three)
            attention, width, i = parent, features(module)[1], i + 3
        elif leaf in FUSED_QKV:
            width = _query_width(block.get_submodule(parent))
            if not width or features(module)[1] != 3 * width:
                _refuse(model, f"{name} fuses q, k and v, but not in three equal parts of q's width {width}")
            plan[name], attention, i = "colwise:3", parent, i + 1
        elif attention is not None:
            if features(module)[0] != width:
                _refuse(model, f"its attention ({attention}) has no output layer taking q's width {width}")
            if not head_dim_of(block.get_submodule(attention)):
                _refuse(model, f"its attention ({attention or 'the block'}) does not say its head size (head_dim)")
            plan[name], i = "rowwise", i + 1
            attentions.append(attention)
            attention = None
        else:
            mlp.append((name, module))
            i += 1
    if not attentions:
        _refuse(model, "no q, k, v projections were found in its blocks")
    d = features(layers[0][1])[0]
    whole_sequence = list(attentions)
    if mlp:
        *ups, (down, last) = mlp
        m = features(last)[0]
        if not ups or any(features(u) != (d, m) for _, u in ups) or features(last)[1] != d:
            _refuse(model, f"its MLP ({', '.join(n for n, _ in mlp)}) is not layers {d} -> {m} then one {m} -> {d}")
        plan.update((n, "colwise") for n, _ in ups)
        plan[down] = "rowwise"
        # the MLP's own module takes every token once for all its up layers; not one that holds attention too
        whole_sequence += [p for p in {n.rpartition(".")[0] for n, _ in ups}
                           if not any(a == p or a.startswith(f"{p}.") for a in attentions)]
    for name, module in block.named_modules():
        own = list(module.parameters(recurse=False))
        if not own or name in plan:
            continue
        if any(name == a or name.startswith(f"{a}.") for a in attentions if a):
            _refuse(model, f"{name} ({type(module).__name__}) holds parameters inside attention")
        if not name or any(q.dim() != 1 or q.numel() != d for q in own):
            _refuse(model, f"{name or 'a block'} ({type(module).__name__}) holds parameters that are not a "
                           f"norm over the block's width {d}")
        plan[name] = "sequence"
    return plan, [n for n in whole_sequence if n]


def _vocab_layers(model, blocks):
    """(input embedding name, its module, output layer name or None), outside the blocks:
    as transformers says them (get_input_embeddings), else the largest nn.Embedding and a
    linear layer over its vocabulary."""
    names = {id(m): n for n, m in model.named_modules()}
    hf = next((m for m in model.modules() if callable(getattr(m, "get_input_embeddings", None))), None)
    try:
        emb, head = hf.get_input_embeddings(), getattr(hf, "get_output_embeddings", lambda: None)()
    except (AttributeError, NotImplementedError):   # no transformers model, or one that does not say
        emb = head = None
    if id(emb) in names and type(emb) is nn.Embedding:
        return names[id(emb)], emb, names.get(id(head)) if head is not None and _linear(head) else None
    outside = [(n, m) for n, m in model.named_modules() if not n.startswith(f"{blocks}.")]
    embeddings = [(n, m) for n, m in outside if type(m) is nn.Embedding]
    if not embeddings:
        return None, None, None
    name, emb = max(embeddings, key=lambda nm: nm[1].num_embeddings)
    heads = [n for n, m in outside if _linear(m) and features(m) == (emb.embedding_dim, emb.num_embeddings)]
    return name, emb, heads[-1] if heads else None


def plan_for(model, vocab=True):
    """The tensor-parallel plan of ``model`` (see above), for ``pt.tensor.parallelize``;
    ``vocab=False`` leaves the embedding and the output layer whole. Raises a ValueError
    naming what it did not recognise."""
    stack, blocks = _stack(model)
    inner, whole_sequence = _block_plan(model, blocks[0])
    plan = {f"{stack}.*.{name}": style for name, style in inner.items()}
    for name in whole_sequence:
        plan[f"{stack}.*.{name}"] = "+".join(filter(None, (plan.get(f"{stack}.*.{name}"), "gather_input")))
    last = len(blocks) - 1
    plan[f"{stack}.0"] = "split_input+gather_output" if last == 0 else "split_input"
    if last:
        plan[f"{stack}.{last}"] = "gather_output"
    emb_name, emb, head = _vocab_layers(model, stack)
    if not vocab or emb is None:
        return plan
    cuttable = all(getattr(emb, k, off) == off for k, off in UNSUPPORTED.items())
    tied = head is not None and model.get_submodule(head).weight is emb.weight
    if cuttable:
        plan[emb_name] = "vocab"
    if head is not None and (cuttable or not tied):
        plan[head] = "colwise_gather"
    return plan
