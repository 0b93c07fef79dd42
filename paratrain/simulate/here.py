"""What ``paratrain simulate`` knows of this machine and of the built-in models, measured here.

- ``workload_of("gpt")``: a WORKLOAD for a built-in model (``model = "gpt"`` in
  a WORKLOAD.toml, or ``--workload gpt``): its parameters and shape from the
  task itself, and ``step_compute_ms`` timed here: forward, backward and the
  optimizer's step on one worker's default batch in one process on one
  thread (the median of twenty steps after a warm-up), as ``paratrain train``'s
  workers compute; with ``alongside`` other processes computing the same
  step meanwhile, as a job's other workers on this host do (two computing
  processes here slow each other by 1.2-1.5x: they share the caches and the
  memory bus).
- ``cluster_here()``: ``--cluster here``, this host as one node of as many
  devices as it has cores, its link the one ``paratrain simulate --calibrate``
  fitted (calibration.json); the direct all-reduce's constants, since that is
  what paratrain runs inside a host.

How each part is timed (on one thread, beside the job's other workers, once,
at one pace) is timing.py's.
"""
import json
import os
import time

from .calibrate import CROWDED
from .collectives import Link
from .compute_only import ComputeOnlyGroup, cut_copy
from .crowding import Crowding
from .system import Cluster, Workload
from .timing import batches, kept, once, paired, task_of, time_step, timed_of, training_steps


def _shape(task):
    """(layers, hidden, seq_len) of a built-in task's model, where it has them."""
    c = task.config
    if "n_layer" in c:
        return c["n_layer"], c["n_embd"], c["block_size"]
    if "layers" in c and "width" in c:
        return c["layers"], c["width"], c.get("positions")
    if "sizes" in c:
        return len(c["sizes"]) - 1, max(c["sizes"][1:-1] or c["sizes"]), 1
    return None, None, None


def matrix_width(model):
    """The width h for which PowerSGD's factors of h x h matrices are as large a share as of
    this model's weights (each viewed as shape[0] x the rest): sum(m n) / sum(m + n)."""
    shapes = [(p.shape[0], p[0].numel()) for p in model.parameters() if p.dim() >= 2]
    return round(sum(m * n for m, n in shapes) / sum(m + n for m, n in shapes)) if shapes else None


def layer_outputs(task, batch_size):
    """(layers, mean bytes of a layer's output for ``batch_size`` samples), measured: the
    model's modules that hold parameters directly (a convolution, a linear layer), in one
    forward with hooks. For models whose task does not say its shape (the digits CNN)."""
    import torch
    leaves = [m for m in task.model.modules() if any(True for _ in m.parameters(recurse=False))]
    sizes = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel() * out.element_size()))
             for m in leaves]
    try:
        x, _ = next(iter(torch.utils.data.DataLoader(task.train_set, batch_size=batch_size)))
        with torch.no_grad():
            task.model(x)
    finally:
        for h in hooks:
            h.remove()
    return len(leaves), (sum(sizes) / len(sizes) if sizes else None)


def step_seconds(model, batch, seed=0, alongside=0):
    """A training step (time_step) on ``batch`` samples of built-in ``model`` here, on one
    thread, with ``alongside`` processes computing beside it."""
    return once((model, batch, alongside), model, batch, seed, alongside,
                 lambda: time_step(task_of(model, seed), batch))


def cut_step_seconds(model, batch, tp, seed=0, alongside=0):
    """A training step (training_steps) on ``batch`` samples of built-in ``model`` cut across
    ``tp`` workers by its tensor plan (as paratrain train --tp cuts it), one worker's share,
    on one thread; its collectives left out (ComputeOnlyGroup); each step timed just after
    a whole step (timing.paired)."""
    task = task_of(model, seed)
    if task.tensor_plan is None:
        raise ValueError(f"{model} has no tensor plan: paratrain train --tp does not cut it")

    return paired((model, batch, "tp", tp, alongside), model, batch, seed, alongside,
                  lambda: training_steps(task, batch, model=cut_copy(task, tp)))


def zero3_compute_seconds(model, batch, workers, seed=0, alongside=0):
    """A ZeRO-3 worker's forward and backward on ``batch`` samples of built-in ``model``
    among ``workers``, as its run counts its compute (train/strategies/zero.py: less the
    time blocked in the engine's collectives), on a pt.ZeRO stage-3 engine over a
    ComputeOnlyGroup, one thread. Stage 3 adds to a plain step what a plain step's timing
    cannot show: each unit's buffer allocated before its gather and freed after it, the
    hooks around each unit, and the copies of the gathers it prefetches. A real group
    copies those on its communication lane while the unit before computes, on the same
    cores here; this group copies them where they are issued, in the compute's time."""
    import copy

    from ..parallel.zero import ZeRO
    from ..train.optimizer import FUSED, optimizer_class
    task = task_of(model, seed)

    def steps():
        cls, hyper = optimizer_class(task.defaults["optimizer"], task.defaults["lr"])
        engine = ZeRO(copy.deepcopy(task.model), cls, stage=3, group=ComputeOnlyGroup(workers), **hyper, **FUSED)
        for samples in batches(task, batch):
            blocked, t0 = engine.blocked_seconds(), time.perf_counter()
            task.loss(engine, samples).backward()
            computed = time.perf_counter() - t0 - (engine.blocked_seconds() - blocked)
            engine.step()
            engine.zero_grad()
            yield computed
    return paired((model, batch, "zero3", workers, alongside), model, batch, seed, alongside, steps)


def pipeline_actions(model, microbatch, stages, schedule, microbatches, tp=1, seed=0, alongside=0):
    """The StageActions of built-in ``model`` in a ``stages``-rank pipeline under
    ``schedule`` with ``microbatches`` micro-batches of ``microbatch`` samples, each stage
    cut across ``tp`` ranks: every rank's F, B and W as the engine runs them
    (stage_actions.py), each rank on one thread of a process of its own, as many at once
    as compute at once here (in place of those ``alongside``)."""
    from . import stage_actions
    task = task_of(model, seed)
    return once((model, microbatch, "pipeline", stages, schedule, microbatches, tp, alongside), model,
                microbatch * microbatches, seed, alongside,
                lambda: stage_actions.seconds(task, microbatch, stages, schedule, microbatches, tp,
                                              together=alongside + 1))


def encode_seconds(model, spec, replicas, tp=1, seed=0, alongside=0):
    """A worker's compression of a step's gradients of built-in ``model`` under ``spec``
    (paratrain train's --compression word) among ``replicas`` ranks, on one thread: the
    compressor DataParallel calls on its bucket (parallel/compression/), over a group
    whose collectives move nothing (compressed.py prices what they send), on the whole
    model's gradients or, with ``tp``, a cut worker's shards. compressed.py's formula
    (four passes over the gradients at a memory rate) sees none of top-k's selection nor
    PowerSGD's products and orthogonalisation, tensor by tensor: for gpt it gives 1.3 ms
    where the compressors take 7-9."""
    import torch

    from ..parallel import compression
    task = task_of(model, seed)

    def calls():
        cut = cut_copy(task, tp)
        grads = [torch.randn_like(p) for p in cut.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        start, group, compressor = flat.clone(), ComputeOnlyGroup(replicas), compression.parse(spec)
        compressor.prepare(group, [flat], shapes=[[g.shape for g in grads]] if compressor.wants_shapes else None)
        while True:
            flat.copy_(start)
            t0 = time.perf_counter()
            compressor(group, 0, flat)
            yield time.perf_counter() - t0
    return once((model, "encode", spec, replicas, tp, alongside), model, task.defaults["batch_size"], seed,
                 alongside, lambda: timed_of(calls()))


def optimizer_seconds(model, seed=0, alongside=0):
    """The task's optimizer step over every parameter of built-in ``model`` (each with a
    gradient), on one thread: what a pipeline stage adds to its micro-batches once a step,
    for its share of the parameters (a whole step's timing has it already)."""
    import copy

    import torch

    from ..train.optimizer import make_optimizer
    task = task_of(model, seed)

    def steps():
        copied = copy.deepcopy(task.model)
        optimizer = make_optimizer(task.defaults["optimizer"], copied.parameters(), task.defaults["lr"])
        for p in copied.parameters():
            p.grad = torch.randn_like(p)
        while True:
            t0 = time.perf_counter()
            optimizer.step()
            yield time.perf_counter() - t0
    return once((model, "optimizer", alongside), model, task.defaults["batch_size"], seed, alongside,
                 lambda: timed_of(steps()))


def server_update_seconds(model, seed=0, alongside=0):
    """The task's optimizer over every parameter of built-in ``model`` as a parameter server
    runs it (paratrain/ps/optimizers.py: torch's kernels one after another on a numpy
    shard's views, its square roots numpy's, one step over one flat buffer: ps/fused.py's
    round), on one thread: the update the servers make in place of the workers' own
    optimizer_seconds (the workers step torch's fused kernel instead)."""
    import numpy as np

    from ..ps.optimizers import make_optimizer
    from ..train.optimizer import optimizer_class
    task = task_of(model, seed)

    def steps():
        name = task.defaults["optimizer"]
        _, hyper = optimizer_class(name, task.defaults["lr"])
        optimizer = make_optimizer(name, **hyper)
        rng = np.random.default_rng(seed)
        n = sum(p.numel() for p in task.model.parameters())
        values, summed = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
        while True:
            t0 = time.perf_counter()
            optimizer.step(values, summed, grad_scale=0.5)
            yield time.perf_counter() - t0
    return once((model, "server update", alongside), model, task.defaults["batch_size"], seed, alongside,
                 lambda: timed_of(steps()))


def ps_step_seconds(model, consistency="asp", seed=0, alongside=0):
    """A parameter-server worker's step outside its forward and backward, as ``paratrain
    train --strategy ps`` takes it (train/strategies/ps.py) beside one server on this host:
    Client.step (its gradients into the server's shared segment piece by piece, the
    doorbell, the server's optimizer step over them, under ASP and SSP its copy of the
    weights into the worker's pull region, the answer, the weights into the model) and the
    zeroing of the gradients for the next step. One worker, the server forked from this
    process, a forward and backward between two steps (a step's compute leaves the
    caches cold). Under BSP one worker's push completes the round. gpt here: 3.9-6.3 ms,
    where the server's update alone takes 1.3 and a memcpy's calibrated rate gives the
    three copies 0.3: each of the 53 pieces costs its views and a call on each side, and
    the two processes hand over twice."""
    from . import ps_step
    task = task_of(model, seed)

    def steps():
        with ps_step.beside_a_server(task, consistency) as (worker, client):
            yield from ps_step.step_times(task, worker, client, batches(task, task.defaults["batch_size"]))
    return paired((model, "ps step", consistency, alongside), model, task.defaults["batch_size"], seed, alongside,
                  steps)


def stage_send_seconds(nbytes):
    """A pipeline's bundle of ``nbytes`` of activations one way between two stages on this
    host, as the engine sends it (stage_send.py), once per size until forget_timings."""
    from . import stage_send
    return kept(("stage send", int(nbytes)), lambda: stage_send.seconds(nbytes))


class Measured:
    """What plan.py times of built-in ``model`` here: a whole step, a pipeline's stages
    as the engine runs them and a micro-batch's send to the next stage, a tensor-parallel worker's share, a ZeRO-3
    worker's forward and backward on its engine, a compressor's call, the optimizer on a
    worker and on the parameter servers, a parameter-server worker's step outside its
    compute; ``alongside`` others computing."""

    def __init__(self, model, seed=0, alongside=0):
        self.model, self.seed, self.alongside = model, seed, alongside

    def step(self, batch):
        return step_seconds(self.model, batch, self.seed, alongside=self.alongside)

    def actions(self, microbatch, stages, schedule, microbatches, tp=1):
        return pipeline_actions(self.model, microbatch, stages, schedule, microbatches, tp, self.seed, self.alongside)

    def cut(self, batch, tp):
        return cut_step_seconds(self.model, batch, tp, self.seed, self.alongside)

    def optimizer(self):
        return optimizer_seconds(self.model, self.seed, self.alongside)

    def zero3(self, batch, workers):
        return zero3_compute_seconds(self.model, batch, workers, self.seed, self.alongside)

    def server_update(self):
        return server_update_seconds(self.model, self.seed, self.alongside)

    def ps_step(self, consistency):
        return ps_step_seconds(self.model, consistency, self.seed, self.alongside)

    def stage_send(self, nbytes):
        return stage_send_seconds(nbytes)

    def encode(self, spec, replicas, tp=1):
        return encode_seconds(self.model, spec, replicas, tp, self.seed, self.alongside)


def workload_of(model, batch_size=None, seed=0, alongside=0):
    """The Workload of built-in model ``model``, its step timed here on one thread (with
    ``alongside`` processes computing beside it)."""
    from ..train.tasks import TASKS
    if model not in TASKS:
        raise ValueError(f"model = {model!r}: not a built-in model; choose from {', '.join(TASKS)}")
    task = task_of(model, seed)
    batch = batch_size or task.defaults["batch_size"]
    seconds = step_seconds(model, batch, seed, alongside)
    layers, hidden, seq_len = _shape(task)
    activations = None
    if layers is None:
        layers, activations = layer_outputs(task, batch)
        hidden = matrix_width(task.model)
    params = sum(p.numel() for p in task.model.parameters())
    return Workload(f"{model} (measured here)", params, 4, batch, float(seconds), layers=layers, hidden=hidden,
                    seq_len=seq_len, activation_bytes=activations, step_jitter_s=seconds.jitter)


def cluster_here(calibration):
    """This host as a cluster, its link from the stored calibration (``calibration`` its path)."""
    try:
        with open(calibration) as f:
            stored = json.load(f)
        links = stored["links"]
        name = "shm_direct" if "shm_direct" in links else next(iter(links))
        link = Link(**links[name])
        shared = name + CROWDED if name + CROWDED in links else name   # ranks sharing the cores: calibrate.py
        crowded = Link(**links[shared]) if shared != name else None
        contention = float(stored.get("contention", {}).get(shared, 1.0))
        crowding = Crowding(**stored["crowding"]) if stored.get("crowding") else None
    except FileNotFoundError:
        raise ValueError(f"--cluster here needs this machine's links: run `paratrain simulate --calibrate` "
                         f"first (no {calibration})") from None
    except (ValueError, KeyError, TypeError, StopIteration):
        raise ValueError(f"{calibration} is not a calibration paratrain wrote: run `paratrain simulate "
                         "--calibrate` again") from None
    cores = stored.get("cores") or os.cpu_count()
    return Cluster(f"this host ({cores} cores, calibrated)", 1, max(cores, 8), link, link,
                   host_algorithms=("direct",), cores=cores, contention=contention, crowding=crowding,
                   crowded=crowded)
