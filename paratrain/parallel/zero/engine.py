"""pt.ZeRO: data parallelism without its redundancy (Rajbhandari et al., "ZeRO",
arXiv 1910.02054, sec. 5).

    engine = pt.ZeRO(model, torch.optim.Adam, stage=2, group=g, lr=1e-3)
    loss = loss_fn(engine(x), y)
    loss.backward()
    engine.step()
    engine.zero_grad()

Every replica of plain data parallelism holds all parameters (4 bytes each in
fp32), all gradients (4) and all optimizer state (8 for Adam's two moments):
16 bytes a parameter, though each rank could hold 1/N of what it only updates.
Parameters are laid out in units and shards as layout.py says; rank r owns
chunk r of every unit, and its optimizer steps only those chunks (an
elementwise optimizer, as Adam and SGD with momentum are, gives the same
numbers on a flat chunk as on the tensors it came from):

- stage 1 (P_os): the optimizer state is sharded. Backward leaves full
  gradients; ``step`` reduce-scatters (averages) each unit's gradients so rank
  r gets its chunk, steps, then all-gathers the updated chunks back into the
  model's parameters (which are views of each unit's flat buffer).
- stage 2 (P_os+g): gradients too. As backward finishes a unit, its gradients
  are reduce-scattered into the owner's chunk and the full ones dropped, so no
  full gradient outlives its unit. Units are reduced in one fixed order on
  every rank (the reverse of the model's: the order backward produces them),
  a unit ready early waiting for the ones before it, and whatever backward did
  not reach (unused parameters) at its end: every rank runs the same
  collectives in the same order, as DDP's buckets do (arXiv 2006.15704, sec.
  3.2.3).
- stage 3 (P_os+g+p): parameters too. The units are the model's repeated
  blocks (found, or named with ``units=``: classes, module names or a
  predicate) and the root holding the rest (units.py); a unit's full
  parameters exist only while it runs forward or backward, gathered from the
  chunks and freed after, whatever its module returns (gather.py). With
  ``prefetch`` (the default) the next unit's gather starts as a unit starts.

Tied weights (one parameter under two names) are sharded once, in every
stage; autograd sums both uses into its one gradient.

Checkpoints come full (``full_state_dict``, ``full_optimizer_state``: loadable
at any world size or stage, or by one process) or sharded
(``sharded_state_dict``: this rank's chunks alone, nothing gathered).

The memory this holds is measured by ``memory()`` (the storages actually
allocated), to set beside the paper's formulas: DP (4+4+8)P, stage 1
(4+4)P + 8P/N, stage 2 4P + 12P/N, stage 3 16P/N.
"""
import contextlib
import math
import time

import torch
from torch import nn

from ...trace import recorder as trace
from .gather import Gathering, untracked
from .layout import bucket_units, layer_units, parameter_names
from .memory import held_bytes, optimizer_tensors

STAGES = (1, 2, 3)


class ZeRO:
    """``pt.ZeRO(model, optimizer_class, stage, group, **optimizer_kwargs)``: the model
    trained as data parallelism with ZeRO's ``stage`` (1, 2 or 3) of sharding.

    bucket_mb: stages 1 and 2's unit size. prefetch: stage 3 starts the next unit's
    gather as a unit starts. units: stage 3's units (units.py): None to find the
    model's repeated blocks, or block classes, qualified module names, or a
    predicate ``(name, module) -> bool``."""

    elastic_sharded = True   # pt.elastic.State: the ranks hold different parts, committed by elastic_commits()

    def __init__(self, model, optimizer_class, stage=1, group=None, bucket_mb=25.0, prefetch=True, units=None,
                 **optimizer_kwargs):
        from ...comm import world
        if stage not in STAGES:
            raise ValueError(f"ZeRO: stage must be 1, 2 or 3, got {stage!r}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"ZeRO: model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
            raise TypeError("ZeRO: give the optimizer's class and its keyword arguments, e.g. "
                            "pt.ZeRO(model, torch.optim.Adam, stage=2, lr=1e-3), not an optimizer object")
        if units is not None and stage != 3:
            raise ValueError(f"ZeRO: units= is for stage 3 (the modules gathered around their forward); stage {stage} "
                             "cuts the parameters in buckets of bucket_mb instead")
        self.module, self.stage = model, stage
        self._made_with = dict(optimizer_class=optimizer_class, stage=stage, bucket_mb=bucket_mb, prefetch=prefetch,
                               units=units, **optimizer_kwargs)
        self.group = group or world()
        self.world_size, self.rank = self.group.world_size, self.group.rank
        self.units = (layer_units(model, self.world_size, units) if stage == 3
                      else bucket_units(model, self.world_size, bucket_mb * 1e6))
        self.names = parameter_names(model)          # a tied parameter has several
        self.order = list(reversed(self.units))     # the order backward finishes them
        for u in self.units:
            self._shard(u)
        self.optimizer = optimizer_class([u.shard for u in self.units], **optimizer_kwargs)
        self._round_reset()
        self._stage1_reduced = False
        self._commits = None   # pt.elastic's, made when a State first commits this engine
        self._hooks = []
        if stage >= 2:
            for u in self.units:
                for _, p in u.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, u=u: self._on_grad(u)))
        self.gathering = (Gathering(self.units, self.group, prefetch, self._backward_started) if stage == 3
                          else None)
        self._moved = 0   # bytes of the buffers this rank reduce-scattered and gathered after a step
        self._blocked = 0.0   # seconds this rank's reduce-scatters and all-gathers blocked it (blocked_seconds)

    def regroup(self, group):
        """Go on over ``group``, a world of another size that pt.elastic formed: this engine
        is laid out anew in place (the same collectives a worker joining the group makes
        in its constructor, from rank 0's values; a new optimizer over the new shards).
        What it should then hold comes from the last commit (``elastic_commits().sync``)."""
        commits = self._commits
        self.close()
        if self.stage == 3:   # the parameters are freed between uses: give them their shapes back
            for u in self.units:
                for _, p in u.params:
                    p.data = torch.zeros(p.shape, dtype=p.dtype)
        self.__init__(self.module, group=group, **self._made_with)
        self._commits = commits

    def elastic_commits(self):
        """pt.elastic.State's commits of this engine's shards, each with a copy on the next
        rank (zero/elastic.py)."""
        if self._commits is None:
            from .elastic import Commits
            self._commits = Commits(self)
        return self._commits

    def close(self):
        """Take this engine's hooks off the model's parameters and modules."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.gathering:
            self.gathering.close()

    def bytes_moved(self):
        """Bytes of the buffers this rank handed to its collectives so far (the reduce-scatters'
        inputs and the all-gathers' outputs): 2 n a step in stages 1 and 2, 3 n in stage 3
        (Rajbhandari et al., sec. 7), n being the parameters' bytes."""
        return self._moved + (self.gathering.gathered_bytes if self.gathering else 0)

    def blocked_seconds(self):
        """Seconds this rank has waited in its reduce-scatters, stages 1 and 2's all-gathers
        after the step and stage 3's gathers (a prefetched one: only what was left when its
        unit needed it), so far: a training step counts them as waiting for the others, not
        as compute."""
        return self._blocked + (self.gathering.blocked_seconds if self.gathering else 0.0)

    @contextlib.contextmanager
    def _blocking(self, u):
        """A collective of unit ``u``'s, labelled with it in the trace, its time added to
        blocked_seconds."""
        t0 = time.perf_counter()
        with trace.label(u.name):
            yield
        self._blocked += time.perf_counter() - t0

    @property
    def prefetched(self):
        """Stage 3: gathers started ahead of their unit (prefetch), for tests and the curious."""
        return self.gathering.prefetched if self.gathering else 0

    # ---- layout -----------------------------------------------------------------------------

    def _shard(self, u):
        """Pack the unit in a flat buffer (rank 0's values: every rank starts alike),
        make its parameters views of it, and take this rank's chunk."""
        flat = u.flat_of([p.detach() for _, p in u.params])
        self.group.broadcast(untracked(flat) if self.stage == 3 else flat, 0)
        u.flat = flat
        for (_, p), view in zip(u.params, u.views(flat)):
            p.data = view
        mine = flat[self.rank * u.chunk:(self.rank + 1) * u.chunk]
        if self.stage < 3:
            u.shard = nn.Parameter(mine)        # a view: stepping it writes the model's own parameters
        else:
            u.shard = nn.Parameter(mine.clone())
            u.gathered = True                   # until Gathering frees it

    def _gather(self, u):
        if self.gathering:
            self.gathering.gather(u)

    def free(self, u):
        """Stage 3: let the unit's gathered parameters go (after its state changed under them)."""
        if self.gathering:
            self.gathering.free(u)

    # ---- gradients --------------------------------------------------------------------------

    def _round_reset(self):
        self._ready = {id(u): 0 for u in self.units}
        self._next = 0
        self._queued = False

    def _backward_started(self):
        """Once a backward: what it did not reach is reduced at its end (``_end_of_backward``)."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad(self, u):
        self._backward_started()
        self._ready[id(u)] += 1
        while self._next < len(self.order) and self._ready[id(self.order[self._next])] == len(self.order[self._next].params):
            self._reduce(self.order[self._next])
            self._next += 1

    def _end_of_backward(self):
        """The units backward did not reach (unused parameters), in the same order on every rank."""
        while self._next < len(self.order):
            self._reduce(self.order[self._next])
            self._next += 1
        self._round_reset()
        if self.gathering:
            self.gathering.end_of_backward()

    def _reduce(self, u):
        """This rank's chunk of the unit's averaged gradient, added to the shard's; the
        full gradients dropped (stage 3: and the gathered parameters)."""
        flat = u.flat_of([p.grad for _, p in u.params])
        mine = torch.empty(u.chunk, dtype=flat.dtype)
        with self._blocking(u):
            self.group.reduce_scatter(mine, flat, op="avg")
        self._moved += flat.nbytes
        if u.shard.grad is None:
            u.shard.grad = mine
        else:
            u.shard.grad.add_(mine)
        for _, p in u.params:
            p.grad = None
        self.free(u)

    # ---- the step ---------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _stage1_gradients(self):
        if self.stage == 1 and not self._stage1_reduced:
            for u in self.order:
                self._reduce(u)
            self._stage1_reduced = True

    def clip_grad_norm_(self, max_norm):
        """Scale the gradients so their global 2-norm is at most ``max_norm`` (as
        torch.nn.utils.clip_grad_norm_), the norm summed over every rank's chunks;
        returns the norm before clipping."""
        self._stage1_gradients()
        local = torch.zeros(1, dtype=torch.float64)
        for u in self.units:
            if u.shard.grad is not None:
                local += u.shard.grad.double().pow(2).sum()
        self.group.all_reduce(local, op="sum")
        norm = math.sqrt(float(local))
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for u in self.units:
                if u.shard.grad is not None:
                    u.shard.grad.mul_(coef)
        return torch.tensor(norm)

    def step(self):
        self._stage1_gradients()
        self.optimizer.step()
        if self.stage < 3:   # every rank's updated chunks back into every rank's parameters
            for u in self.units:
                with self._blocking(u):
                    self.group.all_gather(u.flat, u.shard.detach().clone())
                self._moved += u.flat.nbytes

    def zero_grad(self):
        for u in self.units:
            u.shard.grad = None
            for _, p in u.params:
                p.grad = None
        self._stage1_reduced = False

    # ---- what it holds ----------------------------------------------------------------------

    def full_state_dict(self):
        """The whole model's state dict (stage 3 gathers each unit for it); on every rank."""
        for u in self.units:
            self._gather(u)
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for u in self.units:
            self.free(u)
        return state

    def load_full_state_dict(self, state):
        """Load a whole model's state dict (a one-process model's, or ``full_state_dict``):
        the model's parameters and this rank's chunks of them. A tied parameter is read
        under whichever of its names the state has."""
        found = {id(q): next((n for n in self.names[id(q)] if n in state), None)
                 for u in self.units for _, q in u.params}
        missing = [self.names[i][0] for i, name in found.items() if name is None]
        if missing:
            raise ValueError(f"ZeRO: the state dict has no {', '.join(missing[:5])}; it is not this model's")
        for u in self.units:
            flat = u.flat_of([state[found[id(q)]] for _, q in u.params])
            with torch.no_grad():
                u.shard.copy_(flat[self.rank * u.chunk:(self.rank + 1) * u.chunk])
                if self.stage < 3:
                    u.flat.copy_(flat)
            self.free(u)   # stage 3: a unit gathered now (the root, between forward and backward) is stale
        buffers = {k: v for k, v in state.items() if k in dict(self.module.named_buffers())}
        self.module.load_state_dict(buffers, strict=False)

    @staticmethod
    def _names(u):
        """The unit's parameters' names in the model's state dict (a tied one's first)."""
        return [n for n, _ in u.params]

    def full_optimizer_state(self):
        """The optimizer's state as a one-process optimizer over ``model.parameters()``
        would have it (each chunk's moments all-gathered and cut back into the
        parameters' shapes): loadable by one process, or by ``load_full_optimizer_state``
        at any world size. Collective: every rank calls it."""
        sd = self.optimizer.state_dict()
        index = {id(q): i for i, q in enumerate(self.module.parameters())}
        state = {}
        for k, u in enumerate(self.units):
            for key, v in sd["state"].get(k, {}).items():
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == u.chunk:
                    whole = torch.empty(u.padded, dtype=v.dtype)
                    self.group.all_gather(whole, v.detach().contiguous())
                    pieces = [t.clone() for t in u.views(whole)]
                else:   # a per-tensor scalar (Adam's step): the same for each of the unit's parameters
                    pieces = [v.clone() if torch.is_tensor(v) else v for _ in u.params]
                for (_, q), piece in zip(u.params, pieces):
                    state.setdefault(index[id(q)], {})[key] = piece
        groups = [dict(sd["param_groups"][0], params=list(range(len(index))))]
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state(self, full):
        """This rank's chunks of a one-process optimizer state (``full_optimizer_state``)."""
        if len(full["param_groups"]) != 1:
            raise ValueError("ZeRO: an optimizer state with several parameter groups cannot be loaded; "
                             "ZeRO steps one group over every chunk")
        index = {id(q): i for i, q in enumerate(self.module.parameters())}
        state = {}
        for k, u in enumerate(self.units):
            entries = [full["state"].get(index[id(q)], full["state"].get(str(index[id(q)]))) for _, q in u.params]
            if any(e is None for e in entries):
                continue
            state[k] = {}
            for key, first in entries[0].items():
                if torch.is_tensor(first) and first.dim() > 0:
                    flat = u.flat_of([e[key] for e in entries])
                    state[k][key] = flat[self.rank * u.chunk:(self.rank + 1) * u.chunk].clone()
                else:
                    state[k][key] = first.clone() if torch.is_tensor(first) else first
        group = dict(full["param_groups"][0], params=list(range(len(self.units))))
        self.optimizer.load_state_dict({"state": state, "param_groups": [group]})

    # ---- sharded checkpoints: each rank its own chunks, nothing gathered ---------------------

    def _layout(self):
        """What must agree for a sharded state to load: the world, the stage, the units."""
        return {"world_size": self.world_size, "stage": self.stage,
                "units": [[self._names(u), u.padded, u.chunk] for u in self.units]}

    def sharded_state_dict(self):
        """This rank's part of the model and optimizer (its chunk of every unit and that
        chunk's optimizer state) and the module's buffers: what a sharded checkpoint
        holds. Not collective and nothing gathered, so every rank saves at once; it loads
        only at the same world size and layout (``full_state_dict`` for another)."""
        return {"zero_sharded": dict(self._layout(), rank=self.rank),
                "shards": [u.shard.detach().clone() for u in self.units],
                "buffers": {k: v.detach().clone() for k, v in self.module.named_buffers()},
                "optimizer": self.optimizer.state_dict()}

    def load_sharded_state_dict(self, state):
        """Load ``sharded_state_dict()`` as this rank saved it. Collective for stages 1-2
        (every rank's chunks are all-gathered back into the model's parameters)."""
        saved, mine = state.get("zero_sharded"), dict(self._layout(), rank=self.rank)
        if not isinstance(saved, dict):
            raise ValueError("ZeRO: not a sharded state dict (no 'zero_sharded' entry); load a full one with "
                             "load_full_state_dict")
        for key, what in (("world_size", "workers"), ("stage", "stage"), ("rank", "rank")):
            if saved.get(key) != mine[key]:
                raise ValueError(f"ZeRO: this sharded state was saved with {what} {saved.get(key)}, this run has "
                                 f"{mine[key]}: a sharded checkpoint loads only where it was written; resume with "
                                 "the workers and stage it was written with, or from a full checkpoint "
                                 "(full_state_dict; paratrain train --checkpoint-format full) to change them")
        if saved.get("units") != mine["units"]:
            raise ValueError("ZeRO: this sharded state's units (parameter names and chunk sizes) differ from this "
                             "model's: another model or bucket size; resume from a full checkpoint")
        with torch.no_grad():
            for u, shard in zip(self.units, state["shards"]):
                u.shard.copy_(shard)
                if self.stage < 3:
                    self.group.all_gather(u.flat, u.shard.detach().clone())
                self.free(u)
        self.module.load_state_dict(state.get("buffers", {}), strict=False)
        self.optimizer.load_state_dict(state["optimizer"])

    def memory(self):
        """Bytes this rank holds, measured as the storages allocated (memory.py):
        parameters (the model's, and stage 3's own chunks), gradients, optimizer state."""
        return held_bytes([p for u in self.units for _, p in u.params] + [u.shard for u in self.units],
                          [p.grad for u in self.units for _, p in u.params] + [u.shard.grad for u in self.units],
                          optimizer_tensors(self.optimizer))
