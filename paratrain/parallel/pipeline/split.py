"""Cut a model between layers into pipeline stages, as a dataflow graph is cut
between devices (TensorFlow inserts a Send/Recv pair on every edge that
crosses devices; Abadi et al., "TensorFlow", OSDI 2016, sec. 3.2.2).

    stage = pt.pipeline.split(model, group=g, stages=2)               # balanced by measured time
    stage = pt.pipeline.split(model, group=g, stages=2, by="params")
    stage = pt.pipeline.split(model, group=g, split_points=["blocks.4"])

1. The model is traced with torch.fx into a graph of operations (an
   nn.Sequential traces as its chain of children). Each operation belongs to
   a *layer*: the outermost submodule it runs in, looking through
   nn.Sequential containers (``blocks.3`` of a GPT, ``features.2`` of the
   digits CNN, ``2`` of a Sequential); operations outside any submodule join
   the next layer. Cuts fall between layers only.
2. The layers are grouped into consecutive runs, one per stage: at the named
   ``split_points``, or so that the most expensive stage is as cheap as
   possible (``balance``), by parameter count or by forward+backward time
   measured on a sample input (on rank 0, then broadcast, so every rank cuts
   alike).
3. ``torch.fx.passes.split_module`` makes one GraphModule per stage. Every
   value that some later stage needs crosses each cut on its way (a skip
   connection over a stage is received by that stage and sent on), so
   stages only ever talk to their neighbours.

The stage a rank gets is a ``Stage``: its chunk of the model (several for the
interleaved schedule, ``virtual=v``: rank r holds stages r, r + p, ...), which
values it receives and sends, and the parameters it owns.
"""
import statistics
import sys
import time

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from .partition import balance


def split(model, group=None, stages=None, split_points=None, by=None, sample=None, virtual=1, verbose=True):
    """This rank's stage of ``model`` cut into ``stages`` x ``virtual`` consecutive stages.

    stages: the number of pipeline ranks (default: the group's size; it must be
    the group's size). virtual: stages per rank (the interleaved schedule).
    split_points: layer names where a stage starts (stages*virtual - 1 of them).
    by: "time" (forward+backward measured on ``sample``, the first stage's
    input; the default when a sample is given) or "params" (the default
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
    gm = trace(model)
    layers = _layers_for(gm, total)
    if split_points is not None:
        starts = _starts_at(layers, split_points, total)
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
    plan = StagePlan(top, total)
    _check_parameters_not_shared(plan, model)
    report = _report(layers, starts, costs, how, plan)
    if verbose and group.rank == 0:
        print(report, file=sys.stderr, flush=True)
    mine = [s for s in range(total) if s % p == group.rank]
    return Stage([plan.chunk(s) for s in mine], mine, total, p, report)


def choose_cut(model, stages, by=None, sample=None, virtual=1, group=None, verbose=False):
    """The layer names where stages 1 .. stages*virtual - 1 start, as ``split`` would
    choose them, the same on every rank of ``group`` (default: the world; measured on
    its rank 0). For a cut that several pipelines must share (data-parallel replicas,
    tensor-parallel ranks): choose once over all of them, then ``split(...,
    split_points=...)`` in each. verbose: rank 0 prints each stage's cost."""
    from ...comm import world
    group = group or world()
    total = int(stages) * int(virtual)
    gm = trace(model)
    layers = _layers_for(gm, total)
    starts, costs, how = _balanced(gm, model, layers, total, by, sample, group)
    if verbose and group.rank == 0:
        bounds = list(zip(starts, starts[1:] + [len(layers)]))
        unit = " ms forward+backward" if how == "time" else " parameters"
        print(f"[pipeline] cut by {how}: " + ", ".join(
            f"stage {k} {layers[a][0]}..{layers[b - 1][0]} {sum(costs[a:b]):,.1f}{unit}"
            for k, (a, b) in enumerate(bounds)), file=sys.stderr, flush=True)
    return [layers[i][0] for i in starts[1:]]


def _layers_for(gm, total):
    layers = find_layers(gm)
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


class _Tracer(fx.Tracer):
    """fx's tracer, with tensor-parallel layers kept whole (their forward is a
    collective, not operations to cut between), so a model cut inside its layers
    can then be cut between them (3D parallelism)."""

    def is_leaf_module(self, m, qualname):
        from ..tensor.checkpoint import CUT
        return isinstance(m, CUT) or super().is_leaf_module(m, qualname)


def trace(model):
    if isinstance(model, fx.GraphModule):
        return model
    try:
        return fx.GraphModule(model, _Tracer().trace(model), model.__class__.__name__)
    except Exception as e:  # noqa: BLE001 - fx raises many kinds; all mean the same to a user
        raise ValueError(
            f"split: torch.fx cannot trace {type(model).__name__} ({type(e).__name__}: {e}). A pipeline cuts "
            "a traced graph: keep Python control flow off tensors in forward (torch._assert instead of "
            "if/raise), give split() an nn.Sequential, or name the cut with split_points after making it "
            "traceable") from None


def find_layers(gm):
    """[(layer name, [nodes])] in graph order: maximal runs of operations under the
    same outermost submodule; operations under none join the next layer."""
    layers, loose = [], []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        key = _layer_of(n.meta.get("nn_module_stack"))
        if n.op == "call_module" and key is None:
            key = str(n.target)
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


def _layer_of(stack):
    """The outermost module an operation runs in that is not an nn.Sequential: a
    Sequential is a list of layers, not one (DigitsCNN's ``features.0`` and
    ``features.2`` are two layers; a ModuleList is never called, so fx never
    shows it)."""
    if not stack:
        return None
    entries = list(stack.items())
    for key, value in entries:
        kind = value[1] if isinstance(value, tuple) and len(value) > 1 else None
        if not (isinstance(kind, type) and issubclass(kind, nn.Sequential)):
            return key
    return entries[-1][0]


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


def _starts_at(layers, split_points, total):
    names = [key for key, _ in layers]
    if len(split_points) != total - 1:
        raise ValueError(f"split: {len(split_points)} split_points for {total} stages; give {total - 1} "
                         f"layer names where a stage starts, from: {', '.join(names)}")
    starts = [0]
    for point in split_points:
        if point not in names:
            raise ValueError(f"split: split point {point!r} is not a layer of the model; layers: {', '.join(names)}")
        i = names.index(point)
        if i <= starts[-1]:
            raise ValueError(f"split: split point {point!r} must come after the previous one and after "
                             f"the first layer, in the model's order: {', '.join(names)}")
        starts.append(i)
    return starts


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
    when ``sample`` goes through the model (median of ``repeats``)."""
    owner = {n: i for i, (_, nodes) in enumerate(layers) for n in nodes}
    top = split_module(gm, model, lambda n: owner[n])
    plan = StagePlan(top, len(layers))
    inputs = sample if isinstance(sample, (tuple, list)) else (sample,)
    values = tuple(inputs)
    out = []
    for s in range(len(layers)):
        chunk = plan.chunk(s)
        times = []
        for _ in range(repeats):
            args = tuple(v.detach().requires_grad_(v.is_floating_point()) if torch.is_tensor(v) else v
                         for v in values)
            t0 = time.perf_counter()
            result = chunk(*args)
            outs = result if isinstance(result, tuple) else (result,)
            grads = [o for o in outs if torch.is_tensor(o) and o.requires_grad]
            if grads:
                torch.autograd.backward(grads, [torch.ones_like(o) for o in grads])
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        out.append(statistics.median(times) * 1e3)
        with torch.no_grad():
            values = chunk(*values) if s < len(layers) - 1 else None
            if values is not None and not isinstance(values, tuple):
                values = (values,)
    return out


class StagePlan:
    """What the split top-level graph says about its stages: for stage s, the
    values it receives (``live_in``: produced before s, needed at s or later,
    in graph order) and the values it sends on (``live_in`` of s + 1)."""

    def __init__(self, top, total):
        self.top, self.total = top, total
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
        return Chunk(s, self.total, getattr(self.top, str(call.target)), call, getitems,
                     self.live_in[s], self.live_in[s + 1] if s + 1 < self.total else None,
                     self.output if s == self.total - 1 else None)


class Chunk(nn.Module):
    """One stage's part of the model: called with the values it receives (the
    model's inputs on stage 0), returns the tuple of values it sends on, or the
    model's output on the last stage."""

    def __init__(self, index, total, module, call, getitems, live_in, live_out, output):
        super().__init__()
        self.index, self.total = index, total
        self.module = module
        self._call, self._getitems = call, getitems
        self._live_in = [n.name for n in live_in]
        self._live_out = None if live_out is None else [n.name for n in live_out]
        self._output = output
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
            return fx.node.map_arg(self._output.args[0], lambda n: env[n.name])
        return tuple(env[name] for name in self._live_out)


class Stage(nn.Module):
    """This rank's stages: ``chunks[i]`` is stage ``indices[i]`` of ``total``."""

    def __init__(self, chunks, indices, total, ranks, report):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.indices, self.total, self.ranks = list(indices), total, ranks
        self.virtual = len(chunks)
        self.report = report

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


def _check_parameters_not_shared(plan, model):
    """A parameter used by two stages (tied weights) would be updated twice, apart."""
    owner, names = {}, {id(q): name for name, q in model.named_parameters()}
    for s in range(plan.total):
        for q in getattr(plan.top, f"submod_{s}").parameters():
            if owner.setdefault(id(q), s) != s:
                raise ValueError(f"split: parameter {names.get(id(q), '?')} is used by stages {owner[id(q)]} and "
                                 f"{s} (tied weights); untie it, or cut so that its users share a stage")


def _report(layers, starts, costs, how, plan):
    total = len(starts)
    unit = "ms" if how == "time" else None
    lines = [f"[pipeline] {total} stages, cut by {how}:"]
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
    return "\n".join(lines)
