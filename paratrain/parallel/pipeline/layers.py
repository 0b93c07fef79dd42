"""The layers of a traced model: the units a pipeline cut falls between.

Every operation of the graph carries the stack of modules it ran in
(``nn_module_stack``: torch.fx and torch.export both record it). Its layer
is the outermost of them that is neither a container nor an nn.Sequential:

- a *container* holds a list of layers: a module whose children are
  numbered (an nn.ModuleList or nn.Sequential: ``blocks`` of a GPT, ``h`` of
  GPT-2, ``layers`` of Llama) and every module above it (``transformer``,
  ``hf``, the model itself). Only the first numbered name on a path counts,
  so a list inside a block (the experts of a mixture-of-experts layer) does
  not cut the block open;
- an nn.Sequential is a list of layers, not one (``features.0`` and
  ``features.2`` of the digits CNN are two layers), unless a split point
  names it;
- the parents of a ``split_points`` name are containers too, so a cut can
  name any module, however deep (``hf.transformer.h.2``).

So a GPT-2 wrapped in a module that returns its logits has the layers
``hf.transformer.wte``, ``hf.transformer.wpe``, ``hf.transformer.h.0`` ...,
``hf.transformer.ln_f``, ``hf.lm_head``. Operations that run in containers
only (the attention mask built once in ``GPT2Model.forward``) join the next
layer, and the values they make cross every later cut they are needed past.
"""
from torch import nn


def find_layers(gm, points=()):
    """[(layer name, [nodes])] in graph order: maximal runs of operations in the same
    layer; operations in containers only join the next layer."""
    stacks = {n: _paths(n) for n in gm.graph.nodes}
    spine = containers([path for paths in stacks.values() for path, _ in paths], points)
    named = set(points)
    layers, loose = [], []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        key = next((path for path, kind in stacks[n]
                    if path not in spine and (path in named or not _is_sequential(kind))), None)
        if key is None:
            loose.append(n)
            continue
        if layers and layers[-1][0] == key:
            layers[-1][1].extend(loose + [n])
        else:
            layers.append((key, loose + [n]))
        loose = []
    if loose:
        if not layers:
            raise ValueError("split: the model has no submodules to cut between")
        layers[-1][1].extend(loose)
    return layers


def containers(paths, points=()):
    """The module names to look inside for layers: each list's and what holds it (see above)."""
    spine = {""}
    for path in paths:
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                spine.update(".".join(parts[:j]) for j in range(i + 1))
                break
    for point in points:
        parts = point.split(".")
        spine.update(".".join(parts[:j]) for j in range(len(parts)))
    return spine


def _paths(node):
    """[(module path, its class or class name)] an operation ran in, outermost first; a
    module's own call counts as running in it."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for key, value in stack.items():
        path, kind = (value[0], value[1]) if isinstance(value, tuple) and len(value) > 1 else (key, None)
        if path and (not out or out[-1][0] != path):
            out.append((path, kind))
    if node.op == "call_module" and not node.meta.get("paratrain_made"):
        if not out or out[-1][0] != str(node.target):
            out.append((str(node.target), None))
    return out


def _is_sequential(kind):
    if isinstance(kind, type):
        return issubclass(kind, nn.Sequential)
    return isinstance(kind, str) and kind.rsplit(".", 1)[-1] == "Sequential"


def layer_params(gm, nodes):
    """Parameter elements a layer's operations use."""
    seen = {}
    for n in nodes:
        if n.op == "call_module":
            for q in gm.get_submodule(n.target).parameters():
                seen[id(q)] = q.numel()
        elif n.op == "get_attr":
            t = _attr(gm, n.target)
            if isinstance(t, nn.Parameter):
                seen[id(t)] = t.numel()
    return sum(seen.values())


def _attr(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def starts_at(layers, split_points, total):
    """The index of the first layer of each stage, from the names where stages 1.. start."""
    names = [key for key, _ in layers]
    if len(split_points) != total - 1:
        raise ValueError(f"split: {len(split_points)} split_points for {total} stages; give {total - 1} "
                         f"layer names where a stage starts, from: {', '.join(names)}")
    starts = [0]
    for point in split_points:
        if point not in names:
            raise ValueError(f"split: split point {point!r} is not a layer of the model (no operation of the traced "
                             f"model runs in a module of that name); its layers: {', '.join(names)}")
        i = names.index(point)
        if i <= starts[-1]:
            raise ValueError(f"split: split point {point!r} must come after the previous one and after "
                             f"the first layer, in the model's order: {', '.join(names)}")
        starts.append(i)
    return starts
