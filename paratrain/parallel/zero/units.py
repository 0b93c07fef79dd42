"""Which modules are stage 3's units, and which unit owns each parameter.

A stage-3 unit is gathered whole while it runs, so the most a rank holds at
once is the largest unit (and the next, prefetched) on top of its 1/N of
everything. Units should therefore be the model's repeated blocks, as FSDP's
auto-wrap policies make them (Zhao et al., "PyTorch FSDP", arXiv 2304.11277,
sec. 3.1: ``transformer_auto_wrap_policy`` wraps each transformer layer):

- ``units=None``: the blocks are found. Walking from the root, a container
  (ModuleList, Sequential, ModuleDict) with two or more children of one
  class names that class a block class (a transformer's layer list: GPT-2's
  ``GPT2Block``, BERT's ``BertLayer``, Llama's ``LlamaDecoderLayer``), and
  every module of a block class is a unit. A model with no such container
  falls back to its layers: each module with parameters reached from the
  root through containers only (``nn.Sequential(Linear, ...)``'s Linears).
- ``units=`` block classes, qualified module names (``"transformer.h.0"``),
  a mix of both, or a predicate ``(name, module) -> bool``, as FSDP's
  ``ModuleWrapPolicy`` and ``lambda_auto_wrap_policy``. Units may nest.

The model itself is one more unit, the root: it owns every parameter no
chosen module encloses (embeddings, the final norm, the head) and, as FSDP's
root wrapper, is gathered for the whole forward and backward. A parameter
reached under two names (tied weights: GPT-2's ``lm_head.weight is
transformer.wte.weight``) belongs to the innermost unit enclosing every name
it has, so it is sharded once and gathered whenever any of its users runs.
"""
import warnings
from collections import Counter

from torch import nn

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
ROOT = "(root)"


def _trainable(module):
    return any(q.requires_grad for q in module.parameters())


def block_classes(model):
    """The classes two or more children of one container share, for the containers met
    from the root outside any block already found, in the order met."""
    found = []

    def visit(module):
        kids = [c for c in module.children() if _trainable(c)]
        repeated = ({cls for cls, n in Counter(type(c) for c in kids).items() if n >= 2}
                    if isinstance(module, CONTAINERS) else set())
        for c in kids:
            if type(c) in repeated:
                if type(c) not in found:
                    found.append(type(c))
            else:
                visit(c)
    visit(model)
    return found


def _outermost(model, chosen):
    """(name, module) for each module ``chosen(name, module)`` picks, not looking inside one picked."""
    out = []

    def visit(prefix, module):
        for name, child in module.named_children():
            path = prefix + name
            if chosen(path, child):
                out.append((path, child))
            else:
                visit(path + ".", child)
    visit("", model)
    return out


def _layers(model):
    """The fallback: each module with parameters reached from the root through containers only."""
    out = []

    def visit(prefix, module):
        for name, child in module.named_children():
            if isinstance(child, CONTAINERS):
                visit(f"{prefix}{name}.", child)
            elif _trainable(child):
                out.append((prefix + name, child))
    visit("", model)
    return out


def choose(model, units=None):
    """The modules (qualified name, module) that are units besides the root, in the model's order."""
    if units is None:
        classes = tuple(block_classes(model))
        return (_outermost(model, lambda name, m: isinstance(m, classes)) if classes else _layers(model))
    if callable(units) and not isinstance(units, type):
        picked = units
    else:
        items = [units] if isinstance(units, (str, type)) else list(units)
        wrong = [x for x in items if not isinstance(x, (str, type))]
        if wrong:
            raise TypeError(f"ZeRO: units= takes module classes, module names or a predicate (name, module) -> bool; "
                            f"got {wrong[0]!r}")
        names, classes = {x for x in items if isinstance(x, str)}, tuple(x for x in items if isinstance(x, type))
        modules = dict(model.named_modules())
        missing = sorted(names - set(modules))
        if missing:
            examples = ", ".join(repr(n) for n, _ in choose(model)[:3])
            raise ValueError(f"ZeRO: units= names {', '.join(map(repr, missing))}, which is no module of this model; "
                             f"name modules as model.named_modules() does, e.g. {examples}")
        picked = lambda name, m: name in names or isinstance(m, classes)   # noqa: E731
    out = [(n, m) for n, m in model.named_modules() if n and picked(n, m)]
    for n, m in out:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(f"ZeRO: units= picks {n!r}, a {type(m).__name__}, which never runs a forward of its own "
                             f"(so it would never be gathered): pick its items ({n}.0, ...) or their class")
    return out


def assign(model, chosen):
    """[(unit name, module, [(parameter name, parameter)])]: the root first, then the chosen
    modules in order, each with the trainable parameters it owns (none: left out). A
    parameter is owned by the innermost unit enclosing all its names."""
    names = {n for n, _ in chosen}
    aliases, first = {}, []
    for name, q in model.named_parameters(remove_duplicate=False):
        if q.requires_grad:
            if id(q) not in aliases:
                first.append((name, q))
            aliases.setdefault(id(q), []).append(name)

    def enclosing(name):   # the units around a parameter's name, the root ("") included
        parts = name.split(".")[:-1]
        return {""} | {p for p in (".".join(parts[:k]) for k in range(1, len(parts) + 1)) if p in names}

    owned = {n: [] for n in [""] + [n for n, _ in chosen]}
    for name, q in first:
        common = set.intersection(*(enclosing(a) for a in aliases[id(q)]))
        owned[max(common, key=len)].append((name, q))
    out = [(ROOT, model, owned[""])] + [(n, m, owned[n]) for n, m in chosen]
    return [u for u in out if u[2]]


def warn_if_lopsided(model, units):
    """A unit holding most of the model (and parameters of its submodules, so it could be cut
    finer) is gathered whole whenever it runs: stage 3 saves little. Say which and how to cut it."""
    total = sum(q.numel() for _, _, params in units for _, q in params)
    for name, module, params in units:
        share = sum(q.numel() for _, q in params) / total
        prefix = "" if name == ROOT else name + "."
        splittable = any("." in n[len(prefix):] for n, _ in params)
        if share > 0.5 and splittable:
            inner = block_classes(module)
            hint = (f"units=[{inner[0].__module__}.{inner[0].__name__}]" if inner else
                    "units=[...] naming its submodules")
            warnings.warn(f"ZeRO stage 3: unit {name} holds {share:.0%} of the model's parameters and is gathered "
                          f"whole whenever it runs, so stage 3 saves little of its memory; cut it finer with units= "
                          f"(block classes, module names or a predicate (name, module) -> bool), e.g. {hint}",
                          stacklevel=4)
