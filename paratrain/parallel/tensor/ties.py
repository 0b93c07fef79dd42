"""A parameter used in two places (tied embeddings) stays one parameter when its layers are cut.

GPT-2 and BERT use their word embedding as their output layer too (Press &
Wolf, arXiv 1608.05859): one (V, d) tensor, held by the embedding and by the
head. Megatron-LM (arXiv 1909.08053, sec. 3, "parallelizing the output
embedding") cuts the pair alike: the embedding by vocabulary rows
(``"vocab"``) and the head by output features (``"colwise"``), which are the
same rows of the same tensor. So rank r's shard serves both, and its
gradient sums both uses, as the one-process gradient does.

``parallelize`` cuts each module on its own and then points every other
holder of a tied tensor at the first one's shard. Two holders cut different
ways, or one cut and one left whole, cannot share a tensor and are refused
before anything is cut. A holder that is not a layer (BERT's
``cls.predictions.bias``, the decoder's bias held a second time) follows
the shard.
"""
from torch import nn

from .layers import is_conv1d


def _holders(model):
    """{id(parameter): [(module name, attribute)]} of every module holding it directly."""
    out = {}
    for name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            out.setdefault(id(param), []).append((name, attr))
    return out


def _layout(styles, attr, module):
    """How a cut turns ``module.attr`` into this rank's piece, or None for a whole tensor:
    ('rows', parts) for a vocabulary or column cut of a (out, in) weight or a bias,
    ('columns',) for a row cut's weight; a Conv1D's weight is turned, (in, out)."""
    for kind, parts in styles or ():
        turned = attr == "weight" and is_conv1d(module)
        if kind == "vocab" or kind.startswith("colwise"):
            return ("columns" if turned else "rows", parts)
        if kind == "rowwise" and attr == "weight":
            return ("rows" if turned else "columns", 1)
    return None


def tied_groups(model, chosen):
    """[[(module name, attribute), ...]]: the holders of each tensor that the plan cuts
    and that more than one module holds; the cut ones first. Raises when its holders
    would be cut different ways."""
    groups = []
    for holders in _holders(model).values():
        cut = [(m, a) for m, a in holders if _layout(chosen.get(m), a, model.get_submodule(m))]
        if len(holders) < 2 or not cut:
            continue
        layouts = {}
        for m, a in holders:
            module = model.get_submodule(m)
            layout = _layout(chosen.get(m), a, module)
            if layout or isinstance(module, (nn.Linear, nn.Embedding)) or is_conv1d(module):
                layouts[f"{m}.{a}"] = layout
        if len(set(layouts.values())) > 1:
            said = ", ".join(f"{k} ({'cut ' + str(v) if v else 'whole'})" for k, v in layouts.items())
            raise ValueError(f"parallelize: {said} are one tied parameter, but the plan cuts them differently; "
                             "cut both alike (an embedding 'vocab' and its tied head 'colwise' or "
                             "'colwise_gather') or leave both whole")
        groups.append(cut + [h for h in holders if h not in cut])
    return groups


def retie(model, groups):
    """Point every holder of a tied tensor at the first cut holder's shard."""
    for (owner, attr), *others in groups:
        shard = getattr(model.get_submodule(owner), attr)
        for m, a in others:
            setattr(model.get_submodule(m), a, shard)
