"""pt.elastic.State: what a run keeps in memory so that it can go on when the world changes.

    state = pt.elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)
    state.step += 1; state.commit()      # every few steps: a copy in this process's memory
    state.restore()                      # back to the last commit (after a peer died mid-step)
    state.sync(group, root=0)            # root's commit to every rank (a rank that joined)

A commit copies the model's parameters and buffers, the optimizer's state, the
sampler's position (sampler.py) and the plain values (``epoch``, ``step``, any
number, string or list of them) into this process's memory: no disk, as
Horovod's elastic ``State.commit`` (Sergeev and Del Balso, arXiv 1802.05799;
horovod/common/elastic.py) and CheckFreq's in-memory snapshot (Mohan et al.,
FAST 2021) keep it. After a failure every survivor restores its own commit,
then the world takes one survivor's (``sync``), so a rank that joined, or one
that committed a step later than the others, ends up where everyone is.

``sync`` sends a description first, as JSON (names, shapes, dtypes, the
values), then each tensor's bytes, each by broadcast: nothing is pickled,
and a rank whose optimizer has no state yet (Adam before its first step)
learns its shapes from the description.

A commit counts only once the world has agreed on it (the one-number
all-reduce that also asks whether the world moved): a rank that dies in the
middle of a commit leaves the others on the commit before. A model whose
ranks hold different state (``elastic_commits()``: pt.ZeRO's shards, a
pt.DataParallel compressor's residuals) commits that part itself: each
rank's own and a copy of its neighbour's (``snapshot``, ``replicate``), put
back together for a new world in ``sync``. pt.ZeRO is all such state
(``elastic_sharded``); its optimizer is its own, so give no ``optimizer=``.
"""
import copy
import json

import torch

_VALUE_TYPES = (bool, int, float, str, type(None))


class State:
    """``report=False``: pt.elastic.run does not print its line on a change (the caller
    says what happened itself, as paratrain train does)."""

    def __init__(self, model=None, optimizer=None, sampler=None, report=True, **values):
        for name, value in values.items():
            _check_value(name, value)
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "sampler", sampler)
        object.__setattr__(self, "report", bool(report))
        object.__setattr__(self, "_reset_callbacks", [])
        object.__setattr__(self, "_saved", None)
        object.__setattr__(self, "commits", 0)
        object.__setattr__(self, "events", [])   # what pt.elastic.run did: worlds lost and re-formed
        object.__setattr__(self, "_saved", self._take(1))

    # ---- the plain values: state.epoch, state.step, ... ----------------------------------

    def __getattr__(self, name):
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"this elastic State holds no {name!r} (it holds {', '.join(values) or 'no values'}; "
                             "give it as State(..., name=value))")

    def __setattr__(self, name, value):
        if name in ("model", "optimizer", "sampler", "report"):
            object.__setattr__(self, name, value)
            return
        _check_value(name, value)
        self._values[name] = value

    # ---- commit and restore ------------------------------------------------------------------

    def commit(self):
        """Copy everything into this process's memory: the point the run goes back to.
        In an elastic job, then ask whether the launcher has opened a new world (a worker
        lost or one joined): every rank learns it at the same commit (a one-number
        all-reduce, which is also where the world agrees on the commit) and raises
        WorldChanged, which pt.elastic.run answers."""
        pending = self._take(self._saved["commit_id"] + 1)
        if self._per_rank() is not None:
            self._per_rank().replicate(pending["commit_id"])
        moved = _world_moved()
        object.__setattr__(self, "_saved", pending)
        if moved:
            from .run import WorldChanged
            raise WorldChanged(moved)

    def _per_rank(self):
        """The model's commits of what differs between ranks (a ZeRO shard, a compressor's
        residuals), or None."""
        return self.model.elastic_commits() if hasattr(self.model, "elastic_commits") else None

    def _sharded(self):
        return getattr(self.model, "elastic_sharded", False)

    def _take(self, commit_id):
        saved = {"values": copy.deepcopy(self._values), "commit_id": commit_id}
        if self._per_rank() is not None:
            self._per_rank().snapshot(commit_id)
        if self.model is not None and not self._sharded():
            saved["model"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            saved["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        if self.sampler is not None:
            saved["sampler"] = self.sampler.state_dict()
        object.__setattr__(self, "commits", self.commits + 1)
        return saved

    def restore(self):
        """Put the last commit back into the model, the optimizer, the sampler and the values
        (a sharded model's parts come back in ``sync``)."""
        saved = self._saved
        if self._per_rank() is not None:
            self._per_rank().restore(saved["commit_id"])
        if self.model is not None and not self._sharded():
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        if self.sampler is not None:
            self.sampler.load_state_dict(saved["sampler"])
        object.__setattr__(self, "_values", copy.deepcopy(saved["values"]))

    def on_reset(self, fn):
        """Call ``fn(state)`` after each change of the world (to rescale the learning rate,
        say); usable as a decorator."""
        self._reset_callbacks.append(fn)
        return fn

    def reset_callbacks(self):
        for fn in self._reset_callbacks:
            fn(self)

    @property
    def world_size(self):
        from ..comm import world
        return world().world_size

    # ---- one rank's commit to every rank -----------------------------------------------------

    def sync(self, group, root=0):
        """Make ``root``'s last commit every rank's (collective), then restore it."""
        from ..comm.world import broadcast_text
        meta = tensors = None
        if group.rank == root:
            meta, tensors = _flatten(self._saved)
        description = broadcast_text(group, json.dumps(meta) if group.rank == root else None, root)
        if group.rank != root:
            meta = json.loads(description)
            tensors = [torch.empty(shape, dtype=_DTYPES[dtype]) for shape, dtype in meta["tensors"]]
        for t in tensors:
            wire = t.view(torch.uint8) if t.dtype == torch.bool else t
            group.broadcast(wire.reshape(-1), root)
        if group.rank != root:
            object.__setattr__(self, "_saved", _unflatten(meta, tensors))
        self.restore()
        if self._per_rank() is not None:
            self._per_rank().sync(group, root, self._saved["commit_id"])


def _world_moved():
    """Why the world moved since this generation (the launcher opened another), or None;
    the same answer on every rank (collective in an elastic job)."""
    from ..comm import elastic_rendezvous
    from ..comm.world import elastic_generation, world
    store, generation = elastic_generation()
    if store is None:
        return None
    group = world()
    moved = torch.tensor([int(group.rank == 0 and elastic_rendezvous.world_moved(store, generation))])
    group.all_reduce(moved, op="max")
    return f"the launcher opened a world after generation {generation}" if moved.item() else None


_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                                     torch.int8, torch.int16, torch.int32, torch.int64,
                                                     torch.uint8, torch.bool)}


def _check_value(name, value):
    """A plain value: what JSON carries and a commit can copy."""
    if isinstance(value, _VALUE_TYPES):
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_value(name, v)
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for v in value.values():
            _check_value(name, v)
        return
    raise TypeError(f"elastic State value {name!r} is a {type(value).__name__}: give numbers, strings, and lists "
                    "or dicts of them (a model, an optimizer and a sampler have their own arguments)")


def _flatten(saved):
    """(JSON-able description, tensors in order): each tensor replaced by {"tensor": index}."""
    tensors, shapes = [], []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x.contiguous())
            shapes.append([list(x.shape), str(x.dtype).removeprefix("torch.")])
            return {"tensor": len(tensors) - 1}
        if isinstance(x, dict):
            return {"dict": [[walk(k), walk(v)] for k, v in x.items()]}   # optimizer state has int keys
        if isinstance(x, (list, tuple)):
            return {"list" if isinstance(x, list) else "tuple": [walk(v) for v in x]}
        if isinstance(x, float) and x != x:
            return {"nan": True}
        return {"value": x}
    meta = walk(saved)
    return {"saved": meta, "tensors": shapes}, tensors


def _unflatten(meta, tensors):
    def walk(x):
        if "tensor" in x:
            return tensors[x["tensor"]]
        if "dict" in x:
            return {walk(k): walk(v) for k, v in x["dict"]}
        if "list" in x:
            return [walk(v) for v in x["list"]]
        if "tuple" in x:
            return tuple(walk(v) for v in x["tuple"])
        if "nan" in x:
            return float("nan")
        return x["value"]
    return walk(meta["saved"])
