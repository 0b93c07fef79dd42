"""pt.Pipeline: run one training step of a stage under a schedule.

    stage = pt.pipeline.split(model, group=g, stages=2)
    pipe = pt.Pipeline(stage, group=g, microbatches=8, schedule="1f1b", loss_fn=F.cross_entropy)
    opt = torch.optim.Adam(stage.parameters())
    loss = pipe.step(inputs, targets)     # inputs used on the first stage, targets on the last
    opt.step(); opt.zero_grad()

``step`` cuts the batch into m micro-batches, runs this rank's list of
actions (schedules.py) in order, receiving each input just before its
forward or backward and sending each result without waiting (the sends are
waited for at the end of the step), and returns the whole batch's mean loss
on every rank. Each micro-batch's loss is divided by m before its backward,
so the accumulated gradients are those of one process on the whole batch
(``loss_fn`` gives a micro-batch's mean, and micro-batches are equal).

With a schedule that splits the backward (zb-h1), B asks autograd for the
gradients of the stage's inputs and of the outputs of every module that owns
weights, and nothing else, so the weight products are skipped; W then takes
each such module's output gradient back to its own weights only (Qi et al.,
arXiv 2401.10241, sec. 2: B and W of a linear layer are two separate
matrix products, and only B is on the critical path). Normalization layers
and embeddings (``_WEIGHTS_IN_B``) are left to B: their weight gradients are
sums formed in the same kernel as their input's.

Under the other schedules a stage past the first splits its backward the
same way, and runs its W right after B has sent the input gradient: the
previous stage waits for that gradient, not for the weight gradients, and
gets it a W sooner, while the order of micro-batches and the activations
held stay the schedule's. With two stages 1F1B's steady state has no slack
(each stage's next forward waits for the other's backward), so this also
removes the small waits the stages' jitter would make.

A weight that several ranks' stages read (tied input and output embeddings)
is held by each of them: building the Pipeline copies the first holder's
value to the others, and the end of ``step`` sums their gradients between
them (tied.py), so the optimizer step that follows keeps the copies equal.

``dp_group``: this stage's replicas in other pipelines (DP x PP); after the
step their gradients and the loss are averaged over it.

``timeline``: the last step's actions as (kind, microbatch, chunk, start,
end) in seconds from the step's start, the start taken once the action's
input had arrived: the gaps are the bubble.

``peak_activation_bytes``: the most bytes of activations this rank held at
once in the last step. Each forward counts the bytes autograd saves for its
backward (``saved_tensors_hooks``; parameters and tensors already counted
excluded); they are held until the micro-batch's backward (its W, when the
backward is split). GPipe holds all m micro-batches' at its peak, 1F1B at
most p - r on rank r.
"""
import time

import torch
import torch.utils._pytree as pytree

from ...trace import recorder as trace
from .. import linear_grads
from . import schedules, tied, transport
from .trace import TensorRead
from .transport import differentiable


class Pipeline:
    def __init__(self, stage, group=None, microbatches=1, schedule="1f1b", loss_fn=None, dp_group=None):
        from ...comm import world
        self.stage, self.group, self.dp_group = stage, group or world(), dp_group
        self.p, self.rank = self.group.world_size, self.group.rank
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"Pipeline: microbatches must be an int of at least 1, got {microbatches!r}")
        if schedule not in schedules.SCHEDULES:
            raise ValueError(f"Pipeline: unknown schedule {schedule!r}; choose one of {', '.join(schedules.SCHEDULES)}")
        if loss_fn is None or not callable(loss_fn):
            raise ValueError("Pipeline: loss_fn(output, target) is needed (it gives a micro-batch's mean loss)")
        if stage.ranks != self.p:
            raise ValueError(f"Pipeline: the stage was split for {stage.ranks} ranks, the group has {self.p}")
        if stage.virtual > 1 and schedule != "interleaved":
            raise ValueError(f"Pipeline: this rank holds {stage.virtual} stages (split with virtual="
                             f"{stage.virtual}); only schedule='interleaved' runs several, or split with virtual=1")
        self.m, self.schedule, self.loss_fn = microbatches, schedule, loss_fn
        self._agree()
        tied.copy_from_first(self.group, stage.tied, stage.total)
        self.actions = schedules.actions(schedule, self.rank, self.p, self.m, stage.virtual)
        self.split_backward = schedule in schedules.SPLIT_BACKWARD
        self._capture = None
        if any(self._splits(chunk.index) for chunk in stage.chunks):
            self._hook_weight_owners()
        # past the first stage's last F, its B's feed nobody: its W's may fill their waits
        forwards = [i for i, (kind, _, _) in enumerate(self.actions) if kind == "F"]
        self._free_tail = (forwards[-1] + 1 if self.split_backward and stage.is_first and not stage.is_last
                           and forwards else len(self.actions))
        self.timeline = []
        self.peak_activation_bytes = 0
        self.saved_per_forward = []          # bytes each forward of the last step saved for its backward
        self._held = 0
        self._param_storages = {q.untyped_storage().data_ptr() for q in stage.parameters()}
        self._saved_by_shape = {}   # (chunk, input shapes, grad mode): bytes its forward saves

    # ---- before anything runs: every rank must run the same pipeline -----------------------

    def _agree(self):
        mine = torch.tensor([self.m, schedules.SCHEDULES.index(self.schedule), self.stage.virtual,
                             self.stage.total], dtype=torch.int64)
        every = torch.zeros(self.p * 4, dtype=torch.int64)
        self.group.all_gather(every, mine)
        every = every.view(self.p, 4)
        if not bool((every == every[0]).all()):
            rows = "\n".join(f"  rank {r}: microbatches={int(every[r, 0])}, schedule="
                             f"{schedules.SCHEDULES[int(every[r, 1])]}, stages per rank={int(every[r, 2])}, "
                             f"stages={int(every[r, 3])}" for r in range(self.p))
            raise ValueError(f"Pipeline: the ranks of the pipeline disagree:\n{rows}\n"
                             "every rank must build the same Pipeline from the same split")

    def _check_batch(self, inputs, targets):
        """Every rank learns the batch sizes the first and last stage hold, so a bad
        batch raises the same error on every rank instead of leaving some waiting."""
        def size(x, needed):
            if not needed:
                return -1
            if x is None:
                return -2
            first = x[0] if isinstance(x, (tuple, list)) else x
            return int(first.shape[0]) if torch.is_tensor(first) and first.dim() else -3
        mine = torch.tensor([size(inputs, self.stage.is_first), size(targets, self.stage.is_last)], dtype=torch.int64)
        every = torch.zeros(self.p * 2, dtype=torch.int64)
        self.group.all_gather(every, mine)
        batch, target_batch = int(every[0]), int(every[2 * (self.p - 1) + 1])
        what = {-2: "got None", -3: "is not a batch of tensors"}
        if batch < 0:
            raise ValueError(f"Pipeline.step: the first stage (rank 0) needs inputs, and {what[batch]}")
        if target_batch < 0:
            raise ValueError(f"Pipeline.step: the last stage (rank {self.p - 1}) needs targets, and "
                             f"{what[target_batch]}")
        if batch % self.m:
            raise ValueError(f"Pipeline.step: a batch of {batch} cannot be cut into {self.m} equal micro-batches; "
                             f"use a batch size that {self.m} divides, or another microbatches")
        if target_batch != batch:
            raise ValueError(f"Pipeline.step: {batch} inputs but {target_batch} targets")

    # ---- one step ------------------------------------------------------------------------------

    def step(self, inputs=None, targets=None):
        """One training step over the whole batch; returns its mean loss (a float64
        tensor, the same on every rank). Gradients accumulate into the stage's
        parameters; the optimizer step is the caller's."""
        checking = time.perf_counter()
        self._check_batch(inputs, targets)   # the ranks meet: a rank early from its last step waits here
        t_start = time.perf_counter()
        self._inputs = _microbatches(inputs, self.m) if self.stage.is_first else None
        self._targets = _microbatches(targets, self.m) if self.stage.is_last else None
        self._state, self._losses, self._works = {}, [], []
        self.timeline = []
        self._held = self.peak_activation_bytes = 0
        self.saved_per_forward = []
        self._t_start, self._weights_done = t_start, set()
        self.waited_seconds = t_start - checking   # this step's time waiting on its neighbours: at the
        # start, for their values, at the end
        self.sent_bytes = 0         # and the bytes this stage sent
        try:
            for i, (kind, mb, c) in enumerate(self.actions):
                if kind == "W" and (mb, c) in self._weights_done:
                    continue                     # run early, while a B of the first stage's tail waited
                if kind == "B" and i >= self._free_tail:
                    self._weights_while_waiting(mb, c)
                self._run(kind, mb, c)
            ended = time.perf_counter()   # from here on, the step waits on its neighbours
            for work, _ in self._works:
                work.wait()
            self.sent_bytes = sum(t.numel() * t.element_size() for _, t in self._works)
            tied.sum_gradients(self.group, self.stage.tied, self.stage.total)
        finally:
            self._state, self._works, self._inputs, self._targets = {}, [], None, None
        loss = torch.zeros(1, dtype=torch.float64)
        if self.stage.is_last:
            loss[0] = float(sum(float(x) for x in self._losses)) / self.m
        self.group.broadcast(loss, self.p - 1)
        if self.dp_group is not None:
            self._average_over_replicas(loss)
        # the last sends, the tied weights' sum, the loss and the replicas' average: the last
        # stage waits here for the first to finish its backward (5 ms a gpt step at 2 stages)
        self.waited_seconds += time.perf_counter() - ended
        return loss[0]

    def _run(self, kind, mb, c):
        called = time.perf_counter()
        began = {"F": self._forward, "B": self._backward, "W": self._weights}[kind](mb, c)
        self.waited_seconds += began - called   # for its input: activations or gradients from a neighbour
        if kind == "W":
            self._weights_done.add((mb, c))
        ended = time.perf_counter()
        self.timeline.append((kind, mb, c, began - self._t_start, ended - self._t_start))
        if trace.ON:
            trace.add_compute(kind, began, self._cpu_began, {"microbatch": mb, "chunk": c})

    def _weights_while_waiting(self, mb, c):
        """The first stage's tail (past its last F): run pending W's while B's gradient is on its way.

        No stage waits for the first stage's input gradients, and past its last F
        nothing it sends depends on when its B's run, so any order of its last B's
        and W's ends the step at the same time, except that a wait is lost time.
        The static placement (``schedules._zero_bubble_h1``) counts F, B and W as
        equal; where B takes longer than W, the gradient of the last micro-batch
        comes after the W placed before it is done, and a W more fits in the wait."""
        state = self._state[(mb, c)]
        if "sent" not in state:
            return
        if "posted" not in state:
            after = self.stage.chunks[c].index + 1
            state["posted"] = transport.post_gradients(self.group, self._rank_of(after), after, state["sent"])
        works = state["posted"][1]
        while not all(w.is_completed() for w in works):
            pending = [key for key, st in self._state.items() if "wgrads" in st]
            if not pending:
                return
            self._run("W", *min(pending))

    def _rank_of(self, stage_index):
        return stage_index % self.p

    def _forward(self, mb, c):
        chunk = self.stage.chunks[c]
        s = chunk.index
        if s == 0:
            values = self._inputs[mb]
            values = values if isinstance(values, tuple) else (values,)
        else:
            values = transport.recv_activations(self.group, self._rank_of(s - 1), s)
            for v in differentiable(values):
                v.requires_grad_(True)
        began = time.perf_counter()
        self._cpu_began = trace.cpu_now() if trace.ON else None
        self._capture = [] if self._splits(s) else None
        shape = (c, tuple(tuple(v.shape) if torch.is_tensor(v) else None for v in values), torch.is_grad_enabled())
        saved = None if shape in self._saved_by_shape else _SavedBytes(self._param_storages)
        try:
            if saved is None:
                out = chunk(*values)
            else:
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    out = chunk(*values)
                self._saved_by_shape[shape] = saved.bytes
        finally:
            captured, self._capture = self._capture, None
        saved_bytes = self._saved_by_shape[shape]
        self._held += saved_bytes
        self.saved_per_forward.append(saved_bytes)
        self.peak_activation_bytes = max(self.peak_activation_bytes, self._held)
        state = {"inputs": values if s > 0 else (), "captured": captured, "saved_bytes": saved_bytes}
        if s == self.stage.total - 1:
            loss = self.loss_fn(out, self._targets[mb])
            self._losses.append(loss.detach())
            state["outputs"], state["grads"] = [loss / self.m], [None]
        else:
            out = out if isinstance(out, tuple) else (out,)
            transport.send_activations(self.group, out, self._rank_of(s + 1), s + 1, self._works)
            state["sent"] = differentiable(out)
        self._state[(mb, c)] = state
        return began

    def _backward(self, mb, c):
        chunk = self.stage.chunks[c]
        s = chunk.index
        state = self._state[(mb, c)]
        if "sent" in state:
            if "posted" in state:
                grads, works = state.pop("posted")
                for w in works:
                    w.wait()
            else:
                grads = transport.recv_gradients(self.group, self._rank_of(s + 1), s + 1, state["sent"])
            pairs = [(o, g) for o, g in zip(state.pop("sent"), grads) if o.requires_grad]
            state["outputs"], state["grads"] = [o for o, _ in pairs], [g for _, g in pairs]
        began = time.perf_counter()
        self._cpu_began = trace.cpu_now() if trace.ON else None
        leaves = differentiable(state["inputs"])
        outputs, grads = state.pop("outputs"), state.pop("grads")
        if not self._splits(s):
            if outputs:
                torch.autograd.backward(outputs, grads)
            input_grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
        else:
            input_grads = self._input_gradients_only(chunk, state, leaves, outputs, grads)
        if s > 0:
            transport.send_gradients(self.group, input_grads, self._rank_of(s - 1), s, self._works)
        state["inputs"] = ()
        if not self.split_backward:
            self._weight_gradients(mb, c)        # W at once, the input gradient on its way: B's span
        return began

    def _splits(self, s):
        """Whether stage s's backward is split into B (input gradients) and W (weight
        gradients): under a zero-bubble schedule always, W placed by the schedule;
        under the others on every stage but the first, W run as soon as B's input
        gradient is sent, so the previous stage, which waits for it, gets it a W
        earlier, and the schedule's order and memory stay as they were."""
        return self.split_backward or s > 0

    def _input_gradients_only(self, chunk, state, leaves, outputs, grads):
        """B of a split backward: gradients of the inputs, of each weight-owning
        module's output (kept for W), and of parameters no such module owns."""
        captured = [(mod, inp, out) for mod, inp, out in state["captured"] if out.requires_grad]
        loose = parameters_left_to_b(chunk, [mod for mod, _, _ in captured])
        wanted = leaves + [out for _, _, out in captured] + loose
        if not outputs or not wanted:
            state["wgrads"] = []
            return [torch.zeros_like(x) for x in leaves]
        got = torch.autograd.grad(outputs, wanted, grads, retain_graph=True, allow_unused=True)
        n, k = len(leaves), len(captured)
        input_grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(got[:n], leaves)]
        state["wgrads"] = [(mod, inp, out, g) for (mod, inp, out), g in zip(captured, got[n:n + k]) if g is not None]
        _accumulate(loose, got[n + k:])
        state["keep"] = outputs     # the graph W walks stays alive until W
        return input_grads

    def _weights(self, mb, c):
        """W as an action of its own (a zero-bubble schedule places it): its span starts here."""
        began = time.perf_counter()
        self._cpu_began = trace.cpu_now() if trace.ON else None
        self._weight_gradients(mb, c)
        return began

    def _weight_gradients(self, mb, c):
        """Each weight-owning module's output gradient back to its own weights."""
        state = self._state.pop((mb, c))
        for mod, inp, out, g in state.get("wgrads", []):
            unchanged = inp is not None and inp[0]._version == inp[1]   # (changed in place since: autograd says so)
            weight_gradients(mod, inp[0] if unchanged else None, out, g)
        self._held -= state["saved_bytes"]

    def _hook_weight_owners(self):
        """Record, during a forward, the output of every module that owns weights, and
        a plain nn.Linear's input (its W is then two products of our own)."""
        def hook(module, args, output):
            if self._capture is not None and torch.is_tensor(output):
                x = linear_input(module, args)
                self._capture.append((module, None if x is None else (x, x._version), output))
        for chunk in self.stage.chunks:
            for mod in weight_owners(chunk.module):
                mod.register_forward_hook(hook)

    # ---- forward only (evaluation) ----------------------------------------------------------

    @torch.no_grad()
    def forward(self, inputs=None):
        """The model's output for a whole batch (no micro-batches, no gradients), on
        every rank of the pipeline: the last stage sends it to the others. Every
        rank calls it, in the same order; ``inputs`` matter on the first stage. The output
        reaches the other ranks as its tensors (and None, ints), in the model's structure:
        a tensor, a tuple, list or dict of them, or a dataclass torch.export flattened (a
        Hugging Face ModelOutput)."""
        if self.stage.output_unsendable:
            raise ValueError(f"Pipeline.forward: the model returns an object of class "
                             f"{self.stage.output_unsendable}, which cannot be sent to the other ranks: wrap the "
                             "model so that forward returns a tensor, or a tuple, list or dict of tensors")
        works = []
        out = None
        for chunk in self.stage.chunks:
            s = chunk.index
            if s == 0:
                values = inputs if isinstance(inputs, tuple) else (inputs,)
            else:
                values = transport.recv_activations(self.group, self._rank_of(s - 1), s)
            out = chunk(*values)
            if s < self.stage.total - 1:
                transport.send_activations(self.group, out, self._rank_of(s + 1), s + 1, works)
        last, done = self.p - 1, self.stage.total   # tag range past the last stage: the output
        spec = self.stage.output_spec                # every rank knows the output's structure
        if self.rank == last:
            leaves = tuple(spec.flatten_up_to(out)) if spec is not None else (out,)
            for r in range(self.p - 1):
                transport.send_activations(self.group, leaves, r, done, works)
        else:
            leaves = transport.recv_activations(self.group, last, done)
            out = pytree.tree_unflatten(list(leaves), spec) if spec is not None else leaves[0]
        for work, _ in works:
            work.wait()
        return out

    # ---- DP x PP ------------------------------------------------------------------------------

    def _average_over_replicas(self, loss):
        params = [q for q in self.stage.parameters() if q.requires_grad]
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        flat = torch.cat([q.grad.reshape(-1) for q in params]) if params else torch.zeros(0)
        if flat.numel():
            self.dp_group.all_reduce(flat, op="avg")
            off = 0
            for q in params:
                q.grad.copy_(flat[off:off + q.numel()].view_as(q))
                off += q.numel()
        self.dp_group.all_reduce(loss, op="avg")


class _SavedBytes:
    """Counts the bytes autograd saves during one forward, each storage once,
    the stage's parameters not at all (they are not activations).

    A Python call for every tensor autograd saves costs: gpt's forward of 4 samples
    saves 109 and takes 8-15% longer with this hook (11.7-15.4 ms against 12.6-17.7).
    A forward of the same chunk on inputs of the same shapes saves the same bytes, so
    the engine counts each (chunk, shapes) once and runs the others without it."""

    def __init__(self, param_storages):
        self.params = param_storages
        self.seen, self.bytes = set(), 0

    def pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += storage.nbytes()
        # detached: an output saved by its own node would otherwise hold that node in a
        # reference cycle (tensor -> grad_fn -> saved tensor), freed only by the cyclic GC
        return t.detach()

    @staticmethod
    def unpack(t):
        return t


# Modules whose weight gradients B computes along with their input's, in the same kernel
# (a normalization's weight and bias gradients are two sums over what its input gradient
# reads anyway), so W does not read their input and output gradient a second time; and a
# traced graph's read of a weight (trace.py), whose output is the weight itself.
_WEIGHTS_IN_B = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm,
                 torch.nn.Embedding, TensorRead)


def _own_params(module):
    return [q for q in module._parameters.values() if q is not None and q.requires_grad]


def weight_owners(module):
    """The modules inside ``module`` (not itself) whose weight gradients W computes: each
    owning a trainable parameter of its own, but for those of _WEIGHTS_IN_B."""
    return [m for m in module.modules() if m is not module and _own_params(m) and not isinstance(m, _WEIGHTS_IN_B)]


def parameters_left_to_b(module, owners):
    """``module``'s trainable parameters that none of ``owners`` holds: B computes their
    gradients along with the inputs'."""
    covered = {id(q) for m in owners for q in _own_params(m)}
    return [q for q in module.parameters() if q.requires_grad and id(q) not in covered]


def linear_input(module, args):
    """A plain nn.Linear's input (its forward's ``args``), from which weight_gradients makes
    its W; None for any other module."""
    if type(module) is torch.nn.Linear and len(args) == 1 and torch.is_tensor(args[0]):
        return args[0]
    return None


def weight_gradients(module, x, out, grad):
    """W of one weight owner, added to its parameters' .grad from ``grad``, the gradient of
    its output ``out``: a plain nn.Linear given its input ``x`` (linear_input's) by two
    products of our own, any other (``x`` None) by one autograd call for its own weights
    only (asked together, a module's output gradient would also flow back through the
    modules before it and add to their weights what their own output gradients already hold)."""
    if x is not None:
        _linear_weight_gradients(module, x, grad)
        return
    params = _own_params(module)
    _accumulate(params, torch.autograd.grad(out, params, grad, retain_graph=True, allow_unused=True))


@torch.no_grad()
def _linear_weight_gradients(linear, x, g):
    """W of an nn.Linear: weight += g^T x, bias += the sum of g over the tokens, straight
    into .grad (linear_grads.py's products). The same sums autograd would form, without an
    autograd call per layer and a new tensor for each result."""
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    if linear.weight.requires_grad:
        linear_grads.accumulate(linear.weight, linear_grads.WeightProduct(g2, x2))
    if linear.bias is not None and linear.bias.requires_grad:
        linear_grads.accumulate(linear.bias, linear_grads.BiasProduct(g2))


def _accumulate(params, grads):
    for q, g in zip(params, grads):
        if g is None:
            continue
        if q.grad is None:
            q.grad = g.detach().clone()
        else:
            q.grad.add_(g)


def _microbatches(x, m):
    """x (a tensor, or a tuple of tensors) cut along dim 0 into m pieces of the same structure."""
    if torch.is_tensor(x):
        return list(x.chunk(m, 0))
    parts = [t.chunk(m, 0) if torch.is_tensor(t) else [t] * m for t in x]
    return [tuple(p) for p in zip(*parts)]
