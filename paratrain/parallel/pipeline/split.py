"""Cut a model between layers into pipeline stages, as a dataflow graph is cut
between devices (TensorFlow inserts a Send/Recv pair on every edge that
crosses devices; Abadi et al., "TensorFlow", OSDI 2016, sec. 3.2.2).

    stage = pt.pipeline.split(model, group=g, stages=2)               # balanced by parameters
    stage = pt.pipeline.split(model, group=g, stages=2, sample=x)     # balanced by measured time
    stage = pt.pipeline.split(model, group=g, split_points=["blocks.4"])
    stage = pt.pipeline.split(LogitsOf(hf), group=g, sample=ids, split_points=["hf.transformer.h.2"])

1. The model becomes a graph of operations (trace.py): an nn.Sequential the
   chain of its children, kept whole; another model traced by torch.fx, or,
   where fx cannot (Hugging Face models), by torch.export on ``sample``.
2. Each operation belongs to a *layer* (layers.py): the outermost module it
   runs in that is not a container of layers (``blocks.3`` of a GPT,
   ``hf.transformer.h.3`` of a wrapped GPT-2, ``features.2`` of the digits
   CNN, ``2`` of a Sequential). Cuts fall between layers only.
3. The layers are grouped into consecutive runs, one per stage: at the named
   ``split_points``, or so that the most expensive stage is as cheap as
   possible (``balance``), by parameter count or by forward+backward time
   measured on a sample input (on rank 0, then broadcast, so every rank cuts
   alike).
4. ``torch.fx.passes.split_module`` makes one GraphModule per stage. Every
   value that some later stage needs crosses each cut on its way (a skip
   connection over a stage is received by that stage and sent on), so
   stages only ever talk to their neighbours. A weight that several stages
   read (tied embeddings) is held by each of them, its gradients summed
   between them after the backward (tied.py).

The last stage returns what the model returns, and ``loss_fn`` gets it: a
tensor, or a tuple, list or dict (None allowed), or a dataclass (a Hugging
Face ModelOutput). ``Pipeline.forward`` sends it to the other ranks as its
tensors, in its structure; a dataclass torch.fx recorded as one value cannot
travel, and forward refuses it (wrap the model to return a dict). A Hugging
Face model that returns its key/value cache cannot be traced: set
``config.use_cache = False``, or wrap it (``hf_models.LogitsOf``).

The stage a rank gets is a ``Stage``: its chunk of the model (several for the
interleaved schedule, ``virtual=v``: rank r holds stages r, r + p, ...), which
values it receives and sends, and the parameters it owns.
"""
import statistics
import sys
import time

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.passes.split_module import split_module

from . import tied
from .layers import find_layers, layer_params, starts_at
from .partition import balance
from .trace import trace


def split(model, group=None, stages=None, split_points=None, by=None, sample=None, virtual=1, verbose=True):
    """This rank's stage of ``model`` cut into ``stages`` x ``virtual`` consecutive stages.

    stages: the number of pipeline ranks (default: the group's size; it must be
    the group's size). virtual: stages per rank (the interleaved schedule).
    split_points: names of the modules where a stage starts (stages*virtual - 1
    of them): layers, or any module inside one (``hf.model.layers.2.mlp``).
    sample: a batch of the first stage's input (the model's positional
    arguments); needed to measure time, and to trace a model torch.fx cannot
    (torch.export runs it). by: "time" (forward+backward measured on
    ``sample``; the default when a sample is given) or "params" (the default
    without one). verbose: rank 0 prints the cut.
    """
    from ...comm import world
    group = group or world()
    p = group.world_size if stages is None else int(stages)
    if p != group.world_size:
        raise ValueError(f"split: stages={p} but the group has {group.world_size} ranks; a pipeline has "
                         "one stage per rank (use virtual=v for several per rank)")
    if int(virtual) < 1:
        raise ValueError(f"split: virtual must be at least 1, got {virtual}")
    total = p * int(virtual)
    traced = trace(model, sample)
    gm = traced.gm
    points = [] if split_points is None else list(split_points)
    layers = _layers_for(gm, total, points)
    if split_points is not None:
        starts = starts_at(layers, points, total)
        how, costs = "split_points", [layer_params(gm, nodes) for _, nodes in layers]
    else:
        starts, costs, how = _balanced(gm, model, layers, total, by, sample, group)
    owner = {}
    for s in range(total):
        end = starts[s + 1] if s + 1 < total else len(layers)
        for _, nodes in layers[starts[s]:end]:
            for n in nodes:
                owner[n] = s
    top = split_module(gm, model, lambda n: owner[n])
    plan = StagePlan(top, total, traced.out_spec)
    shared = tied.shared([getattr(top, f"submod_{s}") for s in range(total)], model)
    report = _report(layers, starts, costs, how, plan, traced.how, shared)
    if verbose and group.rank == 0:
        print(report, file=sys.stderr, flush=True)
    mine = [s for s in range(total) if s % p == group.rank]
    return Stage([plan.chunk(s) for s in mine], mine, total, p, report,
                 tied.held(shared, group.rank, p), plan.output_spec(), _unsendable(traced))


def choose_cut(model, stages, by=None, sample=None, virtual=1, group=None, verbose=False):
    """The layer names where stages 1 .. stages*virtual - 1 start, as ``split`` would
    choose them, the same on every rank of ``group`` (default: the world; measured on
    its rank 0). For a cut that several pipelines must share (data-parallel replicas,
    tensor-parallel ranks): choose once over all of them, then ``split(...,
    split_points=...)`` in each. verbose: rank 0 prints each stage's cost."""
    from ...comm import world
    group = group or world()
    total = int(stages) * int(virtual)
    gm = trace(model, sample).gm
    layers = _layers_for(gm, total)
    starts, costs, how = _balanced(gm, model, layers, total, by, sample, group)
    if verbose and group.rank == 0:
        bounds = list(zip(starts, starts[1:] + [len(layers)]))
        unit = " ms forward+backward" if how == "time" else " parameters"
        print(f"[pipeline] cut by {how}: " + ", ".join(
            f"stage {k} {layers[a][0]}..{layers[b - 1][0]} {sum(costs[a:b]):,.1f}{unit}"
            for k, (a, b) in enumerate(bounds)), file=sys.stderr, flush=True)
    return [layers[i][0] for i in starts[1:]]


def _layers_for(gm, total, points=()):
    layers = find_layers(gm, points)
    if len(layers) < total:
        raise ValueError(f"split: {total} stages but the model has only {len(layers)} layers "
                         f"({', '.join(key for key, _ in layers)}); use fewer stages")
    return layers


def _balanced(gm, model, layers, total, by, sample, group):
    """(first layer of each stage, each layer's cost, how it was measured)."""
    how = by or ("time" if sample is not None else "params")
    if how not in ("time", "params"):
        raise ValueError(f"split: by must be 'time' or 'params', got {by!r}")
    if how == "time" and sample is None:
        raise ValueError("split: by='time' measures each layer on a sample input: pass sample= "
                         "(a batch for the first stage), or by='params'")
    costs = ([layer_params(gm, nodes) for _, nodes in layers] if how == "params"
             else _measured_on_rank0(gm, model, layers, sample, group))
    return balance(costs, total), costs, how


def _measured_on_rank0(gm, model, layers, sample, group):
    """Each layer's time, measured on rank 0 and broadcast: timings differ from rank
    to rank, and every rank must cut at the same places. (Parameter counts are the
    same everywhere and need no message.)"""
    costs = torch.zeros(len(layers), dtype=torch.float64)
    if group.rank == 0:
        costs.copy_(torch.tensor(measure_layers(gm, model, layers, sample), dtype=torch.float64))
    group.broadcast(costs, 0)
    return costs.tolist()


def measure_layers(gm, model, layers, sample, repeats=3):
    """Forward+backward milliseconds of each layer alone, on the values it sees
    when ``sample`` goes through the model: the median of ``repeats`` sweeps over
    every layer, after one sweep untimed. Sweeps, not one layer's repeats after
    another's, so that a slow stretch of a shared host (a neighbour starting up)
    slows one reading of many layers, not every reading of one, which would push
    the cut off balance; the first sweep pays what a layer's first call does
    (its buffers' first allocation), which no later step pays."""
    owner = {n: i for i, (_, nodes) in enumerate(layers) for n in nodes}
    top = split_module(gm, model, lambda n: owner[n])
    plan = StagePlan(top, len(layers))
    chunks = [plan.chunk(s) for s in range(len(layers))]
    inputs, values = [], tuple(sample if isinstance(sample, (tuple, list)) else (sample,))
    with torch.no_grad():   # what each layer sees
        for s, chunk in enumerate(chunks):
            inputs.append(values)
            if s < len(chunks) - 1:
                values = chunk(*values)
                values = values if isinstance(values, tuple) else (values,)

    def forward_backward(s):
        args = tuple(v.detach().requires_grad_(v.is_floating_point()) if torch.is_tensor(v) else v
                     for v in inputs[s])
        t0 = time.perf_counter()
        result = chunks[s](*args)
        grads = [o for o in pytree.tree_leaves(result) if torch.is_tensor(o) and o.requires_grad]
        if grads:
            torch.autograd.backward(grads, [torch.ones_like(o) for o in grads])
        return time.perf_counter() - t0
    sweeps = [[forward_backward(s) for s in range(len(chunks))] for _ in range(1 + repeats)][1:]
    model.zero_grad(set_to_none=True)
    return [statistics.median(times) * 1e3 for times in zip(*sweeps)]


class StagePlan:
    """What the split top-level graph says about its stages: for stage s, the
    values it receives (``live_in``: produced before s, needed at s or later,
    in graph order) and the values it sends on (``live_in`` of s + 1)."""

    def __init__(self, top, total, out_spec=None):
        self.top, self.total, self.out_spec = top, total, out_spec
        self.stage_of, self.calls = {}, {}
        for n in top.graph.nodes:
            if n.op == "placeholder":
                self.stage_of[n] = -1
            elif n.op == "call_module":
                s = int(str(n.target).rsplit("_", 1)[1])
                self.stage_of[n], self.calls[s] = s, n
            elif n.op == "call_function":   # getitem of a stage's outputs: on that stage
                self.stage_of[n] = self.stage_of[n.args[0]]
            elif n.op == "output":
                self.output = n
        if sorted(self.calls) != list(range(total)):
            raise ValueError(f"split: the cut produced stages {sorted(self.calls)}, not 0..{total - 1}: "
                             "some stage has no operations")
        uses = {}
        for n in top.graph.nodes:
            at = total if n.op == "output" else self.stage_of.get(n)
            for a in n.all_input_nodes:
                uses.setdefault(a, []).append(at)
        self.order = [n for n in top.graph.nodes if n in self.stage_of]
        self.live_in = []
        for s in range(total + 1):
            if s == 0:
                self.live_in.append([n for n in self.order if n.op == "placeholder"])
                continue
            self.live_in.append([n for n in self.order
                                 if self.stage_of[n] < s and any(u >= s for u in uses.get(n, []))])

    def chunk(self, s):
        call = self.calls[s]
        getitems = [n for n in self.order if n.op == "call_function" and n.args[0] is call]
        last = s == self.total - 1
        return Chunk(s, self.total, getattr(self.top, str(call.target)), call, getitems,
                     self.live_in[s], self.live_in[s + 1] if not last else None,
                     self.output if last else None, self.out_spec if last else None)

    def output_spec(self):
        """The pytree structure of the model's output, each value the graph returns one
        leaf: every rank knows it, so the last stage may send just the leaves."""
        if self.out_spec is not None:
            return self.out_spec
        return pytree.tree_structure(_value(self.output.args[0], lambda n: _Leaf()))

class Chunk(nn.Module):
    """One stage's part of the model: called with the values it receives (the
    model's inputs on stage 0), returns the tuple of values it sends on, or the
    model's output on the last stage."""

    def __init__(self, index, total, module, call, getitems, live_in, live_out, output, out_spec=None):
        super().__init__()
        self.index, self.total = index, total
        self.module = module
        self._call, self._getitems = call, getitems
        self._live_in = [n.name for n in live_in]
        self._live_out = None if live_out is None else [n.name for n in live_out]
        self._output, self._out_spec = output, out_spec
        self.receives = len(live_in)
        self.sends = None if live_out is None else len(live_out)

    def forward(self, *values):
        if len(values) != len(self._live_in):
            raise ValueError(f"stage {self.index} takes {len(self._live_in)} values ({', '.join(self._live_in)}), "
                             f"got {len(values)}")
        env = dict(zip(self._live_in, values))
        result = self.module(*fx.node.map_arg(self._call.args, lambda n: env[n.name]))
        env[self._call.name] = result
        for g in self._getitems:
            env[g.name] = result[g.args[1]]
        if self._output is not None:
            out = _value(self._output.args[0], lambda n: env[n.name])
            return out if self._out_spec is None else pytree.tree_unflatten(list(out), self._out_spec)
        return tuple(env[name] for name in self._live_out)


def _value(arg, of):
    """An fx argument with each node replaced by ``of(node)``, in plain Python
    containers (fx's own are immutable subclasses): what the model's forward returns."""
    if isinstance(arg, fx.Node):
        return of(arg)
    if isinstance(arg, dict):
        return {k: _value(v, of) for k, v in arg.items()}
    if isinstance(arg, list):
        return [_value(v, of) for v in arg]
    if isinstance(arg, tuple):
        items = [_value(v, of) for v in arg]
        return type(arg)(*items) if hasattr(arg, "_fields") else tuple(items)
    return arg


def _unsendable(traced):
    """The class of an object the model's output holds that cannot travel between
    ranks (a dataclass built in forward, which torch.fx records as one value), or None."""
    if traced.out_spec is not None:
        return None
    output = next(n for n in traced.gm.graph.nodes if n.op == "output")
    for leaf in pytree.tree_leaves(fx.node.map_arg(output.args[0], lambda n: (n,))):
        if isinstance(leaf, fx.Node) and leaf.op == "call_function" and isinstance(leaf.target, type):
            return leaf.target.__name__
    return None


class _Leaf:
    """A value of the graph's output, in the output's structure."""


class Stage(nn.Module):
    """This rank's stages: ``chunks[i]`` is stage ``indices[i]`` of ``total``.
    ``tied``: [(name, parameter, holding ranks)] for the weights this rank shares
    with other ranks (tied.py). ``output_spec``: the model's output structure;
    ``output_unsendable``: the class of an object in it that cannot be sent, or None."""

    def __init__(self, chunks, indices, total, ranks, report, tied=(), output_spec=None, output_unsendable=None):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.indices, self.total, self.ranks = list(indices), total, ranks
        self.virtual = len(chunks)
        self.report = report
        self.tied, self.output_spec, self.output_unsendable = list(tied), output_spec, output_unsendable

    @property
    def is_first(self):
        return self.indices[0] == 0

    @property
    def is_last(self):
        return self.indices[-1] == self.total - 1

    def forward(self, *values):
        """Run this rank's single stage (for a look; training goes through Pipeline)."""
        if self.virtual != 1:
            raise ValueError("a stage with several chunks runs through pt.Pipeline, not by calling it")
        return self.chunks[0](*values)


def _report(layers, starts, costs, how, plan, traced_by, shared):
    total = len(starts)
    unit = "ms" if how == "time" else None
    lines = [f"[pipeline] {total} stages, traced by {traced_by}, cut by {how}:"]
    for s in range(total):
        end = starts[s + 1] if s + 1 < total else len(layers)
        names = [key for key, _ in layers[starts[s]:end]]
        params = sum(q.numel() for q in getattr(plan.top, f"submod_{s}").parameters())
        cost = sum(costs[starts[s]:end])
        timed = f", {cost:.1f} ms forward+backward" if unit == "ms" else ""
        crossing = len(plan.live_in[s + 1]) if s + 1 < total else 0
        layers_text = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)} layers)"
        lines.append(f"  stage {s}: {layers_text}, {params:,} parameters{timed}"
                     + (f", sends {crossing} value{'s' if crossing > 1 else ''} on" if crossing else ""))
    for name, _, stages in shared:
        lines.append(f"  {name} is read by stages {', '.join(map(str, stages))} (tied): each holds it, "
                     "their gradients summed")
    return "\n".join(lines)
