"""An attention module whose projections are cut by heads, made to read this rank's sizes.

Megatron-LM (arXiv 1909.08053, sec. 3) cuts q, k and v by heads: each rank
computes attention for whole heads of its own, with no communication inside.
The projections are cut by ``parallelize``; what is left is the attention
module's own forward, which often reads sizes its ``__init__`` stored:
GPT-2's ``split_size`` (where its fused q, k, v output is split), BERT's
``all_head_size``, older attention's ``num_heads`` in a reshape. After the
cut those must be this rank's share, or the forward splits and reshapes by
the whole model's sizes.

``localize`` divides such attributes of the module itself, never the shared
config, which the rest of the model still reads whole. It divides only what
it can tell is per head: a count of heads, or a width equal to the width of
heads one of its cut projections yields. ``head_dim`` stays (each rank holds
whole heads), and so does the grouped-query ratio (``num_key_value_groups``,
Ainslie et al., arXiv 2305.13245): q and k, v heads are cut alike, so a rank
keeps the same number of q heads per k, v head.
"""
HEAD_DIMS = ("head_dim", "attention_head_size", "head_size")   # the width of one head, by family
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_heads",
               "n_kv_heads")
HEAD_WIDTHS = ("split_size", "all_head_size", "embed_dim", "hidden_size", "inner_dim")


def head_dim_of(module):
    """The width of one attention head, if ``module`` says it (an attention module), else None."""
    for name in HEAD_DIMS:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_heads(parent, name, out_features, parts, p):
    """A projection cut by columns inside an attention module must give every rank whole
    heads of each of its ``parts`` (q, k, v fused: 3), and as many of them: for k and v
    under grouped-query attention, the key-value heads."""
    head_dim = head_dim_of(parent)
    if not head_dim:
        return
    width = out_features // parts
    if width % head_dim:
        raise ValueError(f"parallelize: {name} yields {width} features per part, not a whole number of heads of "
                         f"{head_dim}; pass a plan that leaves it whole")
    heads = width // head_dim
    if heads % p:
        raise ValueError(f"parallelize: {name} feeds {heads} attention heads, which cannot be cut into {p} "
                         f"equal groups (the tensor-parallel size); use a head count {p} divides (under "
                         "grouped-query attention, the key-value heads too)")


def localize(module, widths, p):
    """Divide by ``p`` the head counts and head widths ``module`` stored, in place.
    ``widths``: the width of each part its cut projections yield (q's, k's and v's,
    before the cut). Returns {attribute: (whole, this rank's)}."""
    head_dim = head_dim_of(module)
    changed = {}
    for name in HEAD_COUNTS + HEAD_WIDTHS:
        value = getattr(module, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            continue
        per_head = name in HEAD_COUNTS and head_dim and value * head_dim in widths
        if per_head or (name in HEAD_WIDTHS and value in widths):
            if value % p:
                raise ValueError(f"parallelize: {type(module).__name__}.{name} = {value} cannot be cut into {p} "
                                 "equal pieces (the tensor-parallel size)")
            setattr(module, name, value // p)
            changed[name] = (value, value // p)
    return changed
