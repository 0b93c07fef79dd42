"""A model as a graph of operations to cut: torch.fx where it can, torch.export where it cannot.

A pipeline cuts a dataflow graph (split.py), so the model must first become
one. A torch.fx GraphModule already is one, and is cut as given (traced by a
tracer of the user's own). Otherwise, the first of these that works:

1. An nn.Sequential is its chain of children, each kept whole: nothing inside
   a child is traced, so any module may be a child (a Hugging Face block,
   whose forward torch.fx cannot trace).
2. torch.fx's symbolic trace (Reed et al., "torch.fx", MLSys 2022), with
   tensor-parallel layers kept whole. It needs no input, but every value is a
   stand-in, shapes included: Python may branch on the model's configuration,
   never on a tensor or a shape.
3. The same with the repeated blocks kept whole (the items of the model's
   outermost lists): for a model whose blocks branch but whose top level does not.
4. torch.export on ``sample``, as torch.distributed.pipelining does (PyTorch
   2's tracing; Ansel et al., ASPLOS 2024). It runs forward on fake tensors
   whose shapes are integers (symbolic where they may vary: every dimension
   of the sample's tensors may), so branches on shapes and on the
   configuration are followed: Hugging Face models need this (their attention
   masks are built by code that branches on the sequence length). Export
   treats a dimension of size 1 as the constant 1, so a sample batch of one
   is traced as two copies of it.

A graph reads a tensor attribute (a weight, a buffer, a constant) with
``get_attr``; torch.export's graph reads every weight so. Each read becomes
a call of a module holding that one tensor (``TensorRead``), one per use,
placed just before its user: a stage then holds the weights its operations
read, and a weight read on two stages (tied input and output embeddings) is
held by both (tied.py). Each ``linear`` of a weight (and bias) becomes an
nn.Linear sharing them, so the zero-bubble schedule can split its backward
into B and W (engine.py) as in a model torch.fx traced.
"""
import torch
import torch.fx as fx
from torch import nn

LINEAR = (torch.ops.aten.linear.default, torch._C._nn.linear, nn.functional.linear)


class Traced:
    """The graph module to cut, how it was made, and the pytree structure of its
    output where the graph returns it flattened (torch.export), else None."""

    def __init__(self, gm, how, out_spec=None):
        self.gm, self.how, self.out_spec = gm, how, out_spec


def trace(model, sample=None):
    """``model`` as a Traced graph (see above). ``sample``: the first stage's input, used
    only where torch.fx cannot trace the model."""
    if isinstance(model, fx.GraphModule):
        traced = Traced(_own_graph(model), "given")
    elif isinstance(model, nn.Sequential):
        traced = Traced(_fx(model, _SequentialTracer()), "torch.fx, each child whole")
    else:
        traced = _fx_or_export(model, sample)
    _reads_per_use(traced.gm)
    _linears_as_modules(traced.gm)
    traced.gm.recompile()
    return traced


def _fx_or_export(model, sample):
    try:
        return Traced(_fx(model, _Tracer()), "torch.fx")
    except Exception as e:  # noqa: BLE001 - fx raises many kinds; all mean the same to a user
        first = e
    blocks = _blocks(model)
    if blocks:
        try:
            return Traced(_fx(model, _Tracer(blocks)), "torch.fx, each block whole")
        except Exception:  # noqa: BLE001
            pass
    name = type(model).__name__
    if sample is None:
        raise ValueError(
            f"split: torch.fx cannot trace {name} ({_said(first)}). Pass sample= (a batch of the first "
            "stage's input, the model's positional arguments) and split traces it with torch.export instead, "
            "or give split an nn.Sequential of the model's layers") from None
    try:
        return _export(model, sample)
    except Exception as e:  # noqa: BLE001
        raise ValueError(
            f"split: neither torch.fx nor torch.export can trace {name}. torch.fx: {_said(first)}. "
            f"torch.export: {_said(e)}. {_advice(model, e)}") from None


def _said(e):
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _advice(model, e):
    text = str(e)
    caches = any(getattr(getattr(m, "config", None), "use_cache", False) for m in model.modules())
    if "Cache" in text and caches:
        return ("The model returns its key/value cache (a Hugging Face model with config.use_cache=True): set "
                "config.use_cache = False, or wrap the model so that forward returns the logits "
                "(paratrain.train.hf_models.LogitsOf)")
    if "in output" in text or "not a known type" in text:
        return ("The model must return tensors: a tensor, or a tuple, list or dict of them (None allowed); "
                "register a dataclass it returns with torch.utils._pytree.register_dataclass, or wrap the model "
                "so that forward returns the tensor loss_fn needs")
    return ("Keep Python control flow off tensor values in forward (torch.where or torch.cond instead of "
            "if on a tensor), or give split an nn.Sequential of the model's layers")


class _Tracer(fx.Tracer):
    """fx's tracer, with tensor-parallel layers kept whole (their forward is a
    collective, not operations to cut between), so a model cut inside its layers
    can then be cut between them (3D parallelism); and ``whole``, module names
    kept whole too."""

    def __init__(self, whole=()):
        super().__init__()
        self.whole = set(whole)

    def is_leaf_module(self, m, qualname):
        from ..tensor.checkpoint import CUT
        return isinstance(m, CUT) or qualname in self.whole or super().is_leaf_module(m, qualname)


class _SequentialTracer(_Tracer):
    """An nn.Sequential's children whole (nested Sequentials opened)."""

    def is_leaf_module(self, m, qualname):
        return not isinstance(m, nn.Sequential)


def _fx(model, tracer):
    return fx.GraphModule(model, tracer.trace(model), type(model).__name__)


def _blocks(model):
    """The items of the model's outermost lists: the modules at the first numbered name
    on their path (``h.3``, ``model.layers.3``), lists themselves excluded."""
    names = []
    for name, m in model.named_modules():
        parts = name.split(".")
        first = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if first == len(parts) - 1 and not isinstance(m, (nn.Sequential, nn.ModuleList)):
            names.append(name)
    return names


def _own_graph(gm):
    """A GraphModule given by the user, with a copy of its graph (split rewrites it)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph, type(gm).__name__)


def _export(model, sample):
    from torch.export import Dim
    from torch.fx.graph import _PyTreeCodeGen
    args = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
    args = tuple(torch.cat([a, a]) if torch.is_tensor(a) and a.dim() and a.shape[0] == 1 else a for a in args)
    dims = tuple({d: Dim.AUTO for d in range(a.dim())} if torch.is_tensor(a) and a.dim() else None for a in args)
    gm = torch.export.export(model, args, dynamic_shapes=dims, strict=False).module()
    codegen = gm.graph._codegen
    out_spec = codegen.pytree_info.out_spec if isinstance(codegen, _PyTreeCodeGen) else None
    known = {name for name, _ in model.named_modules(remove_duplicate=False)} - {""}
    for n in list(gm.graph.nodes):
        stack = n.meta.get("nn_module_stack")
        if stack:   # only the model's own modules (export adds markers of its own)
            n.meta["nn_module_stack"] = {k: v for k, v in stack.items() if isinstance(v, tuple) and v[0] in known}
        if n.op == "call_module" and str(n.target) == "_guards_fn" and not n.users:
            gm.graph.erase_node(n)   # checks the input's shapes against the sample's: the stages see micro-batches
    return Traced(gm, "torch.export", out_spec)


class TensorRead(nn.Module):
    """One tensor a graph reads (a weight, a buffer, a constant) as a module, called
    where it is read: a stage then holds what its operations read."""

    def __init__(self, value):
        super().__init__()
        if isinstance(value, nn.Parameter):
            self.value = value
        else:
            self.register_buffer("value", value, persistent=False)

    def forward(self):
        return self.value


def _reads_per_use(gm):
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = _attr(gm, node.target)
        if not torch.is_tensor(value):
            continue          # a submodule (torch.cond's branches): split_module keeps it with its user
        for user in list(node.users):
            name = f"_read{count}_{node.target.replace('.', '_')}"
            count += 1
            gm.add_module(name, TensorRead(value))
            with graph.inserting_before(user):
                read = graph.call_module(name)
            read.meta["paratrain_made"] = True
            user.replace_input_with(node, read)
        graph.erase_node(node)


def _linears_as_modules(gm):
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in LINEAR or len(node.args) < 2 or \
                set(node.kwargs) - {"bias"}:
            continue
        w = node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        reads = [r for r in (w, b) if r is not None]
        weights = [_read_of(gm, r) for r in reads]
        if not all(isinstance(q, nn.Parameter) for q in weights) or weights[0].dim() != 2:
            continue
        linear = nn.Linear.__new__(nn.Linear)     # (nn.Linear() would allocate weights of its own)
        nn.Module.__init__(linear)
        linear.out_features, linear.in_features = weights[0].shape
        linear.weight = weights[0]
        linear.bias = weights[1] if b is not None else None
        name = f"_linear{count}"
        count += 1
        gm.add_module(name, linear)
        with graph.inserting_before(node):
            call = graph.call_module(name, (node.args[0],))
        call.meta = dict(node.meta, paratrain_made=True)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        for r in reads:                           # each read has this one user (_reads_per_use)
            target = str(r.target)
            graph.erase_node(r)
            gm.delete_submodule(target)


def _read_of(gm, node):
    if isinstance(node, fx.Node) and node.op == "call_module" and node.meta.get("paratrain_made"):
        m = gm.get_submodule(node.target)
        if isinstance(m, TensorRead):
            return m.value
    return None


def _attr(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
