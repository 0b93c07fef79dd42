"""ZeRO stage 3: a unit's full parameters exist only while it runs (Rajbhandari
et al., "ZeRO", arXiv 1910.02054, sec. 5.3; Zhao et al., "PyTorch FSDP", arXiv
2304.11277, sec. 3.2-3.3).

A unit's parameters are views of its flat buffer. To gather, the buffer's
storage is allocated and all-gathered from every rank's chunk; to free, it is
resized to nothing (FSDP's way): the parameters keep their shapes, and every
tensor autograd saved from them finds its values again once the buffer is
gathered anew. The whole difficulty is to gather again before anything reads
those values, whatever the unit's module returns (a tensor, a tuple with None
in it, a dict, a dataclass, a Hugging Face ModelOutput):

- Forward: the unit's forward pre-hook gathers it, its forward hook frees it.
  The root (the model, owning embeddings, final norm, head and tied weights)
  stays gathered from its forward to the end of backward, as FSDP keeps its
  root: backward needs it first (the head) and last (the embeddings).
- Backward, the schedule: the forward hook hooks each tensor the unit
  returned that needs a gradient (found by walking tuples, lists, dicts and
  dataclasses; FSDP2's pre-backward hook), so the first gradient to reach
  the unit gathers it and starts gathering the unit that ran before it.
- Backward, the guarantee: while a unit's forward runs, autograd's
  saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) see every
  tensor autograd saves. One that is a view of a unit's buffer is handed
  back in backward only after that unit is gathered. So no backward reads a
  freed buffer, even where a gradient reaches a unit's inside by a way its
  outputs do not show (a cache, an attribute, a type the walk does not open).
  The hooks compose with saved-tensor hooks already in force (activation
  offloading) and keep autograd's check that a saved tensor was not modified
  in place.
- A submodule holding a unit's parameters, run outside that unit's forward
  (called on its own, or shared with another unit), gathers the unit for its
  call.
- After backward: a unit is freed once its gradients are reduced; at the end
  of backward every unit is.

A forward run again inside backward (activation checkpointing) gathers its
unit and leaves it gathered for the backward that follows. A gather that
fails raises a RuntimeError naming the unit.
"""
import ctypes
import dataclasses
from functools import partial

import time

import numpy as np
import torch

from ...trace import recorder as trace
from .units import ROOT


def untracked(t):
    """A tensor on ``t``'s memory (its dtype, flat) whose storage is not ``t``'s. The
    collectives take numpy views of torch tensors, and torch marks a storage that numpy
    has seen unresizable for good; stage 3 frees and re-allocates its buffers' storage
    (``resize_``), so it hands them over this way. Valid while the storage keeps its
    size: for the length of one call."""
    raw = (ctypes.c_byte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8)).view(t.dtype)


def tensors(obj, out=None, seen=None):
    """The tensors in ``obj``: itself, or inside tuples, lists, dicts (a ModelOutput is
    one) and dataclasses, however nested; anything else holds none."""
    out = [] if out is None else out
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif id(obj) in seen:
        return out
    elif isinstance(obj, dict):
        seen.add(id(obj))
        for v in obj.values():
            tensors(v, out, seen)
    elif isinstance(obj, (list, tuple)):
        seen.add(id(obj))
        for v in obj:
            tensors(v, out, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        seen.add(id(obj))
        for f in dataclasses.fields(obj):
            tensors(getattr(obj, f.name, None), out, seen)
    return out


def _in_backward():
    """Is autograd's engine running a backward on this thread? (If torch does not say: no;
    a unit is then freed after a forward run again inside backward, and gathered again
    by the saved-tensor hooks.)"""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _hooks_in_force():
    """The saved-tensor hooks in force (pack, unpack), None if none, or False if torch does not say."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        return top(False) if top is not None else False
    except TypeError:
        return False


def _storage(t):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):   # no storage (sparse, some tensor subclasses)
        return None


class _Saved:
    """A tensor autograd saved: a detached alias (no reference cycle through its grad_fn),
    the unit whose buffer it views (or None), and its version then."""
    __slots__ = ("unit", "tensor", "version")

    def __init__(self, unit, tensor):
        self.unit, self.tensor, self.version = unit, tensor.detach(), tensor._version


class _Outer:
    """A tensor saved through the hooks in force outside ours."""
    __slots__ = ("unpack", "packed")

    def __init__(self, unpack, packed):
        self.unpack, self.packed = unpack, packed


class Gathering:
    """When each stage-3 unit's parameters are gathered and freed (the module docstring).
    ``on_backward()`` is called as a backward first needs a unit (the engine then queues
    its end-of-backward work); ``end_of_backward()`` is the engine's to call."""

    def __init__(self, units, group, prefetch, on_backward):
        self.units, self.group, self.prefetch, self.on_backward = units, group, bool(prefetch), on_backward
        self.root = next((u for u in units if u.name == ROOT), None)
        self._order, self._position, self.order_known, self._pending = [], {}, False, {}
        self._live = {}            # storage address -> unit, for the units whose buffer is allocated
        self._scopes = []          # per hook pair running: ((module, unit), saved-tensor hooks entered, its data)
        self._backward_seen = set()
        self.prefetched = 0        # gathers started ahead of their unit (for tests and the curious)
        self.gathered_bytes = 0    # bytes of the buffers gathered into (the engine's bytes_moved)
        self.blocked_seconds = 0.0  # seconds spent blocked in gathers (the engine's blocked_seconds)
        self.hooks = []            # the module hooks' handles (close() removes them)
        for u in units:
            self._live[_storage(u.flat)] = u
            self.free(u)
            self.hooks += [
                u.module.register_forward_pre_hook(partial(self._before_forward, u), with_kwargs=True),
                u.module.register_forward_hook(partial(self._after_forward, u), with_kwargs=True, always_call=True)]
            for holder in self._holders(u):
                self.hooks += [holder.register_forward_pre_hook(partial(self._before_holder, u)),
                               holder.register_forward_hook(partial(self._after_holder, u), always_call=True)]

    def close(self):
        """Take the hooks off the modules (an engine over a new group replaces this one)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []

    @staticmethod
    def _holders(u):
        """The modules that hold one of the unit's parameters themselves, other than its own module."""
        mine = {id(p) for _, p in u.params}
        found = {}
        for m in u.module.modules() if u.module is not None else ():
            if id(m) != id(u.module) and any(id(q) in mine for q in m.parameters(recurse=False)):
                found[id(m)] = m
        return list(found.values())

    # ---- gathering and freeing ------------------------------------------------------------------

    def gather(self, u, step=0):
        """The unit's full parameters, before its forward (step +1) or backward (-1); then
        the gather of the unit that runs next in that direction is started (prefetch)."""
        self._wait_for(u)
        if not u.gathered:
            self._allocate(u)
            t0 = time.perf_counter()
            try:
                with trace.label(u.name):
                    self.group.all_gather(untracked(u.flat), u.shard.detach())
                    self.gathered_bytes += u.flat.nbytes
            except Exception as e:   # the same error (a CommError stays one: pt.elastic answers it), told where
                e.add_note(f"ZeRO stage 3: while gathering unit {u.name}'s parameters")
                raise
            self.blocked_seconds += time.perf_counter() - t0
            u.gathered = True
        if step > 0 and not self.order_known and torch.is_grad_enabled() and id(u) not in self._position:
            self._position[id(u)] = len(self._order)
            self._order.append(u)
        if self.prefetch and self.order_known and step and id(u) in self._position:
            at = self._position[id(u)] + step
            if 0 <= at < len(self._order):
                self._start_gather(self._order[at])

    def _allocate(self, u):
        u.flat.untyped_storage().resize_(u.padded * u.flat.element_size())
        self._live[_storage(u.flat)] = u

    def _start_gather(self, u):
        """Prefetch (FSDP's forward and backward prefetch, arXiv 2304.11277 sec. 3.3): the
        next unit's all-gather runs on the group's communication lane while this unit
        computes; ``_wait_for`` collects it. Every rank starts the same gathers in the
        same order (the order the first forward ran the units in, the same on every rank)."""
        if u.gathered or id(u) in self._pending:
            return
        self._allocate(u)
        with trace.label(u.name):
            self._pending[id(u)] = self.group.all_gather(untracked(u.flat), u.shard.detach(), async_op=True)
        self.prefetched += 1
        self.gathered_bytes += u.flat.nbytes

    def _wait_for(self, u):
        work = self._pending.pop(id(u), None)
        if work is not None:
            t0 = time.perf_counter()
            try:
                work.wait()
            except Exception as e:
                e.add_note(f"ZeRO stage 3: while gathering unit {u.name}'s parameters (prefetched)")
                raise
            self.blocked_seconds += time.perf_counter() - t0
            u.gathered = True

    def free(self, u):
        self._wait_for(u)   # (a prefetched unit is never freed mid-gather)
        if not u.gathered:
            return
        self._live.pop(_storage(u.flat), None)
        t0 = time.perf_counter() if trace.ON else 0.0
        u.flat.untyped_storage().resize_(0)
        u.gathered = False
        if trace.ON:
            trace.add(f"free {u.name}", "memory", "zero", t0, time.perf_counter(),
                      {"unit": u.name, "bytes": u.padded * u.flat.element_size()})

    def end_of_backward(self):
        """Every unit freed (one gathered again by a late read included); the units' order
        known from the first forward and backward on, so prefetch starts."""
        self.order_known = bool(self._order)
        self._backward_seen.clear()
        for u in self.units:
            self.free(u)

    # ---- forward --------------------------------------------------------------------------------

    def _before_forward(self, u, module, args, kwargs):
        self.gather(u, step=+1)
        inputs = {id(t) for t in tensors((args, kwargs))}
        self._scopes.append(((module, u), self._enter_saving(), inputs))

    def _scope(self, module, u):
        """What this hook pair's pre-hook entered (the innermost such); nothing if it raised
        before (torch runs the forward hook on an error too)."""
        for i in range(len(self._scopes) - 1, -1, -1):
            key, saving, data = self._scopes[i]
            if key[0] is module and key[1] is u:
                del self._scopes[i]
                self._exit_saving(saving)
                return data
        return None

    def _after_forward(self, u, module, args, kwargs, output):
        inputs = self._scope(module, u) or set()
        needs_grad = False
        if torch.is_grad_enabled():
            for t in tensors(output):
                if t.grad_fn is not None and id(t) not in inputs:   # computed here, not passed through
                    t.register_hook(partial(self._before_backward, u))
                    needs_grad = True
        if _in_backward():
            return   # run again inside backward (activation checkpointing): the unit's backward follows
        if u is self.root and needs_grad:
            return   # the root: kept until the end of backward
        self.free(u)

    def _before_holder(self, u, module, args):
        mine = not u.gathered
        if mine:
            self.gather(u)
        self._scopes.append(((module, u), self._enter_saving(), mine))

    def _after_holder(self, u, module, args, output):
        if self._scope(module, u) and not _in_backward():
            self.free(u)

    # ---- backward -------------------------------------------------------------------------------

    def _before_backward(self, u, grad=None):
        """A unit's backward begins (a gradient reached its outputs, or a saved view of its
        buffer is read): gather it, and the first time this backward, prefetch the one before."""
        if _in_backward():
            self.on_backward()
        first = id(u) not in self._backward_seen
        self._backward_seen.add(id(u))
        self.gather(u, step=-1 if first else 0)

    def _enter_saving(self):
        """Our saved-tensor hooks, unless grad is off or they are already the innermost in force."""
        if not torch.is_grad_enabled():
            return None
        outer = _hooks_in_force()
        if outer and getattr(outer[0], "func", None) == self._pack:
            return None
        ctx = torch.autograd.graph.saved_tensors_hooks(partial(self._pack, outer or None), self._unpack)
        try:
            ctx.__enter__()
        except RuntimeError:   # saved-tensor hooks are off here (tracing): the output hooks alone
            return None
        return ctx

    @staticmethod
    def _exit_saving(ctx):
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _pack(self, outer, t):
        u = self._live.get(_storage(t))
        if u is None and outer is not None:
            return _Outer(outer[1], outer[0](t))
        return _Saved(u, t)

    def _unpack(self, saved):
        if type(saved) is _Outer:
            return saved.unpack(saved.packed)
        u, t = saved.unit, saved.tensor
        if u is not None and not u.gathered:
            self._before_backward(u)
            if t.untyped_storage().nbytes() == 0:
                raise RuntimeError(f"ZeRO stage 3: unit {u.name}'s parameters are not allocated after gathering "
                                   "them for backward")
        if t._version != saved.version:
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: [{t.dtype}, {list(t.shape)}] is at version {t._version}; "
                               f"expected version {saved.version} instead")
        return t
