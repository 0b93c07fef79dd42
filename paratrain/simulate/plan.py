"""``paratrain plan``'s ranking: the layouts the workers allow, predicted, ranked, and the command
for each (plan_command.py prints them and runs the first few with ``--verify``).

The layouts: every strategy of ``paratrain compare`` (compare/strategies.py)
at its ``paratrain train`` defaults, and besides them each pipeline depth p
that divides the workers (p <= the model's layers) with 4 and 8
micro-batches, each tensor size t that divides them, and each pipeline of
tensor groups (3D: p x t dividing them); a pipeline's or a tensor group's
workers share one batch (``paratrain train``'s rule), the
other workers' replicas average their gradients. ``paratrain train`` itself
refuses what cannot run (tensor parallelism of a CNN, a width t does not
divide), so plan offers only commands that run. Each is predicted by
simulate's model of its strategy on the cluster (default: this machine,
calibrated) for the model measured here; those predicted to hold more than
``--memory-gb`` a worker are dropped; the rest are ranked by step time for
the same samples, that is by samples/s (a pipeline's step takes one batch
where data parallelism's takes one a worker).
Each tensor group whose workers leave more than one replica is
also offered with the replicas' gradients compressed (top-k and PowerSGD at
train's defaults: ``--tp T --compression``), which pays where the replicas
meet over a slow link. Not enumerated: ZeRO or compression inside a
pipeline, which ``paratrain train`` does not run.
"""
import dataclasses

from . import compressed, here, memory, parameter_server, pipeline, timing, zero
from .calibrate import time_shared
from .step import Unavailable
from .strategies import predict

MICROBATCHES = (4, 8)
COMPRESSIONS = compressed.SPECS   # a tensor group's replicas compressing: train's defaults


@dataclasses.dataclass
class Layout:
    strategy: str          # compare's name
    flags: list            # its paratrain train flags
    dp: int
    pp: int = 1
    tp: int = 1
    microbatches: int = None
    compression: str = None   # a tensor group's replicas compressing their gradients: "topk", "powersgd"

    @property
    def options(self):
        return {"stages": self.pp if self.pp > 1 else None, "tp": self.tp if self.tp > 1 else 1,
                "microbatches": self.microbatches or 4, "compression": self.compression}


def layouts(workers, layers=None):
    """Every layout of ``workers`` workers plan considers (whether train accepts it is asked later)."""
    from ..compare.strategies import NAMES, train_flags
    out = [Layout(name, train_flags(name, workers), workers) for name in NAMES
           if name not in ("pipeline", "pipeline-zb", "tensor")]
    sizes = [d for d in range(2, workers + 1) if workers % d == 0]
    for p in (d for d in sizes if layers is None or d <= layers):
        for t in (1, *(d for d in sizes if workers % (p * d) == 0)):
            cut = ["--tp", str(t)] if t > 1 else []
            for m in MICROBATCHES:
                for name, schedule in (("pipeline", []), ("pipeline-zb", ["--schedule", "zb-h1"])):
                    out.append(Layout(name, ["--strategy", "pipeline", "--stages", str(p), "--microbatches", str(m),
                                             *schedule, *cut], workers // (p * t), pp=p, tp=t, microbatches=m))
    for t in sizes:
        out.append(Layout("tensor", ["--strategy", "allreduce", "--tp", str(t)], workers // t, tp=t))
        if workers // t > 1:
            out += [Layout("tensor", ["--strategy", "allreduce", "--tp", str(t), "--compression", spec],
                           workers // t, tp=t, compression=name) for name, spec in COMPRESSIONS.items()]
    return out


def compare_layout(name, workers):
    """The Layout ``paratrain compare`` runs strategy ``name`` as (its train flags' defaults:
    a pipeline of every worker with 4 micro-batches, a tensor group of every worker; a
    combination's own dp x pp x tp)."""
    from ..compare.strategies import combination, train_flags
    mesh = combination(name)
    if mesh:   # dpD-ppP-tpT: a 1F1B pipeline of 4 micro-batches where it has stages
        dp, pp, tp = mesh
        return Layout("pipeline" if pp > 1 else "tensor", train_flags(name, workers), dp, pp=pp, tp=tp,
                      microbatches=4 if pp > 1 else None)
    if name in ("pipeline", "pipeline-zb"):
        return Layout(name, train_flags(name, workers), 1, pp=workers, microbatches=4)
    if name == "tensor":
        return Layout(name, train_flags(name, workers), 1, tp=workers)
    return Layout(name, train_flags(name, workers), workers)


def alongside(cluster, workers):
    """How many of a job's other workers compute beside each one while plan times the model
    here: as many as share this host's cores with it (none for a cluster elsewhere)."""
    return min(workers, cluster.cores) - 1 if cluster.cores else 0


def predict_compare(model, workers, names, cluster, batch_size=None):
    """{name: predicted Step (step.py: its seconds and their parts)} of compare's runs, for the
    model measured here."""
    beside = alongside(cluster, workers)
    out = {}
    with timing.standing():   # the parts timed one after another, beside the same neighbours
        workload = here.workload_of(model, batch_size, alongside=beside)
        K, heads = _optimizer_and_heads(model)
        for name in names:
            step, _ = predicted(compare_layout(name, workers), workload, cluster, K, heads,
                                here.Measured(model, alongside=beside))
            if not isinstance(step, Unavailable):
                out[name] = step
    return out


def host_pace(model, workers, cluster, batch_size=None):
    """Seconds of the model's whole step on a worker's batch, one thread, beside the job's
    other workers, as the last timings took it (the first part predict_compare times; timed
    now if none has since forget_timings): the units in which compare states how fast each
    run computed, whatever its strategy computes (predict_from_run's speed times this)."""
    return float(here.workload_of(model, batch_size, alongside=alongside(cluster, workers)).step_compute_s)


def whole_steps_per_compute(model, workers, name, cluster, batch_size=None):
    """host_pace over what the model takes a worker of compare's run ``name`` to compute a
    step (worker_compute_seconds, sharing the cores as predicted() shares them), on the last
    timings: how much of the model's whole step a second of that strategy's compute is
    worth (about 1 for data parallelism; nearly 2 for a stage of a 2-stage pipeline). Both
    are timed in one prediction, so the host's pace cancels; what is left is the timings'
    own spread (a pipeline stage's, in a third of a second, the widest)."""
    _layout, workload, _measured, compute = _shared_worker_compute(model, workers, name, cluster, batch_size)
    return workload.step_compute_s / compute


def _shared_worker_compute(model, workers, name, cluster, batch_size=None):
    """(layout, workload, Measured, seconds) of compare's run ``name`` here, on the last
    timings: seconds, what a worker computes a step (worker_compute_seconds) with the cores
    shared as predicted() shares them."""
    beside = alongside(cluster, workers)
    measured = here.Measured(model, alongside=beside)
    workload = here.workload_of(model, batch_size, alongside=beside)
    layout = compare_layout(name, workers)
    shared = time_shared(layout.dp * layout.pp * layout.tp, cluster.cores)
    return layout, workload, measured, worker_compute_seconds(layout, workload, measured) * shared


def worker_compute_seconds(layout, workload, measured):
    """What the model takes a worker's forward and backward in one step of ``layout`` to be,
    on average over the workers, as a run reports them (its metrics' compute_seconds:
    no optimizer, no waiting): the whole model's on its batch; a tensor group's share of
    the cut model; a pipeline's stages' as the engine runs them (pipeline_actions);
    stage 3's on its engine."""
    if layout.pp > 1:
        return pipeline_actions(layout, workload, measured).mean_step_s
    if layout.tp > 1:
        return measured.cut(workload.batch_per_device, layout.tp) - measured.optimizer() / layout.tp
    if layout.strategy == "zero3":
        return measured.zero3(workload.batch_per_device, layout.dp)
    return workload.step_compute_s - measured.optimizer()


def pipeline_actions(layout, workload, measured):
    """The StageActions (stage_actions.py) of pipeline ``layout`` measured here: every
    rank's F, B and W of a micro-batch as the engine runs them under its schedule, its
    stages cut across its tensor groups."""
    return measured.actions(microbatch_samples(layout, workload), layout.pp, pipeline.SCHEDULES[layout.strategy],
                            layout.microbatches or 1, layout.tp)


class AtSpeed:
    """here.Measured's timings, every one ``speed`` times as long and spread by ``spread`` of
    itself (a standard deviation over the median): the model at another speed and
    steadiness of this host (a run's own, predict_from_run)."""

    def __init__(self, measured, speed, spread):
        self.measured, self.speed, self.spread = measured, speed, spread

    def _scaled(self, seconds):
        return timing.Timed.of(seconds * self.speed, seconds * self.speed * self.spread)

    def step(self, batch):
        return self._scaled(self.measured.step(batch))

    def actions(self, microbatch, stages, schedule, microbatches, tp=1):
        return self.measured.actions(microbatch, stages, schedule, microbatches, tp).scaled(self.speed, self.spread)

    def cut(self, batch, tp):
        return self._scaled(self.measured.cut(batch, tp))

    def optimizer(self):
        return self._scaled(self.measured.optimizer())

    def server_update(self):
        return self._scaled(self.measured.server_update())

    def zero3(self, batch, workers):
        return self._scaled(self.measured.zero3(batch, workers))

    def ps_step(self, consistency):
        return self._scaled(self.measured.ps_step(consistency))

    def stage_send(self, nbytes):
        return self._scaled(self.measured.stage_send(nbytes))

    def encode(self, spec, replicas, tp=1):
        return self._scaled(self.measured.encode(spec, replicas, tp))


def in_lockstep(layout):
    """Whether every worker of ``layout`` does the same work and waits for the others each
    step (data parallelism, ZeRO, a tensor group, BSP), so that the slowest sets the
    pace. Not a pipeline (its stages differ) nor ASP and SSP (nobody waits for a round)."""
    return layout.pp == 1 and parameter_server.CONSISTENCY.get(layout.strategy, "bsp") == "bsp"


def predict_from_run(model, workers, name, cluster, compute, batch_size=None, slowest=1.0, mean=1.0):
    """(Step, speed) of compare's run ``name`` predicted at the speed the run computed at.
    ``compute`` is rank 0's compute a step (a timing.Timed of its metrics' compute_seconds:
    their median and spread); ``slowest`` and ``mean``, the slowest worker's and the
    workers' mean over rank 0's (their means over the run). ``speed`` is the run's
    compute over the model's (worker_compute_seconds, sharing the cores as predicted()
    shares them): the slowest worker's where the workers go in lockstep (in_lockstep: a
    shared host may give one of them the slower core for a whole run, and it sets the
    pace), the workers' mean for a pipeline (whose stages the model cuts and weighs
    itself), rank 0's under ASP and SSP. Every timing the model uses is scaled by it and
    spread as the run's steps were (waits.py charges the spread at each
    synchronization). A shared host's speed moves between a timing and the run it
    predicts (by 20-40% within a minute here); this prediction checks the rest of the
    model (communication, overlap, bubbles, waits) at the run's own speed. None where
    the layout is unavailable."""
    layout, workload, measured, modelled = _shared_worker_compute(model, workers, name, cluster, batch_size)
    share = slowest if in_lockstep(layout) else mean if layout.pp > 1 else 1.0
    speed = compute * share / modelled
    spread = compute.jitter / compute
    workload = dataclasses.replace(workload, step_compute_s=workload.step_compute_s * speed,
                                   step_jitter_s=workload.step_compute_s * speed * spread)
    K, heads = _optimizer_and_heads(model)
    step, _ = predicted(layout, workload, cluster, K, heads, AtSpeed(measured, speed, spread))
    return (None, speed) if isinstance(step, Unavailable) else (step, speed)


def _optimizer_and_heads(model):
    """(bytes of optimizer state a parameter, attention heads or None) of built-in ``model``:
    Adam's two moments or SGD's momentum, as its task trains it; heads for a transformer."""
    task = timing.task_of(model)
    K = memory.ADAM if task.defaults["optimizer"] == "adam" else memory.SGD_MOMENTUM
    return K, (task.config.get("n_head") or task.config.get("heads")) if task.blocks else None


def microbatch_samples(layout, workload):
    """The samples of one of a pipeline layout's micro-batches: a device's batch cut m ways."""
    return max(1, workload.batch_per_device // (layout.microbatches or 1))


def compute_seconds(layout, workload, measured=None):
    """A worker's compute in one step of ``layout``: the whole batch's (the workload's) for a
    replica of its own; for a pipeline, the slowest rank's micro-batches as the engine
    runs them (pipeline_actions: a small batch runs less efficiently, and the stages are
    not equal), a pipeline of tensor groups' on their cut stages, and once a step the
    optimizer over its share of the parameters (4 ms of a gpt step's 121 in a 1F1B
    trace); for a tensor group, its worker's share of the cut model on the whole batch
    (the embeddings, norms and loss are not cut); for a parameter server's worker, the step without
    the optimizer, which the servers run (parameter_server.py); for ZeRO's, the step
    with the optimizer over its 1/N of the parameters alone (Rajbhandari et al. 2020:
    each rank updates its partition), stage 3's forward and backward timed on its engine
    (here.zero3_compute_seconds: its buffers, hooks and gathers' copies).
    ``measured`` (here.Measured) times these on the model here; without it they are the
    workload's step scaled down."""
    if layout.pp > 1:
        m = layout.microbatches or 1
        small = microbatch_samples(layout, workload)
        if not measured:
            return m * workload.step_compute_s * small / workload.batch_per_device / layout.pp / layout.tp
        return float(pipeline_actions(layout, workload, measured)) + measured.optimizer() / (layout.pp * layout.tp)
    if layout.tp > 1 and measured:
        return measured.cut(workload.batch_per_device, layout.tp)
    if layout.strategy in parameter_server.CONSISTENCY and measured:   # the servers run the optimizer
        return workload.step_compute_s - measured.optimizer()
    if layout.strategy == "zero3" and measured:   # the engine's own forward and backward, then the same
        computed = measured.zero3(workload.batch_per_device, layout.dp)
        return timing.Timed.of(computed + measured.optimizer() / layout.dp, computed.jitter)
    if layout.strategy in zero.STAGES and measured:   # each worker steps the optimizer on its 1/N alone
        return workload.step_compute_s - measured.optimizer() * (1 - 1 / layout.dp)
    return workload.step_compute_s / layout.tp


def predicted(layout, workload, cluster, optimizer_bytes, heads=None, measured=None, footprint=None):
    """(Step or Unavailable, predicted bytes a worker holds) for ``layout``, the workers of a
    pipeline or tensor group sharing one batch of ``workload``'s. Memory: the layout's
    training state, plus its activations, plus, given a ``footprint`` measured here
    (simulate/footprint.py), what every layout shares, the activations then scaled
    from the measured ones; else the activations by the formula."""
    share = layout.pp * layout.tp
    compute = compute_seconds(layout, workload, measured)
    per_worker = dataclasses.replace(workload, batch_per_device=max(1, workload.batch_per_device // share),
                                     step_compute_s=float(compute),
                                     step_jitter_s=getattr(compute, "jitter", workload.step_jitter_s
                                                           * compute / workload.step_compute_s),
                                     activation_bytes=workload.activation_bytes and workload.activation_bytes / share)
    if layout.pp > 1 and measured:   # every rank's F, B and W as the engine ran them, and a micro-batch's send
        ranks = pipeline_actions(layout, workload, measured).ranks
        sent = workload.layer_activation_bytes("a pipeline") / (layout.microbatches or 1)
        per_worker = dataclasses.replace(per_worker, stage_actions=tuple((r.F, r.B, r.W) for r in ranks),
                                         stage_send_s=float(measured.stage_send(sent)))
    if layout.strategy in parameter_server.CONSISTENCY and measured:   # their optimizer, as they run it,
        bsp = parameter_server.CONSISTENCY[layout.strategy] == "bsp"   # (one worker's SSP is ASP)
        per_worker = dataclasses.replace(per_worker, server_update_s=float(measured.server_update()),
                                         ps_step_s=float(measured.ps_step("bsp" if bsp else "asp")))
    spec = compressed.SPECS.get(layout.compression or layout.strategy)
    if spec and measured:   # the compressor timed on this model's gradients, not the formula's passes
        per_worker = dataclasses.replace(per_worker, encode_s=float(measured.encode(spec, layout.dp, layout.tp)))
    if cluster.cores:   # more workers than cores: each computes (and encodes) on a share of one
        slower = time_shared(layout.dp * share, cluster.cores)
        per_worker = dataclasses.replace(per_worker, step_compute_s=per_worker.step_compute_s * slower,
                                         encode_s=per_worker.encode_s and per_worker.encode_s * slower,
                                         stage_actions=per_worker.stage_actions and tuple(
                                             tuple(x * slower for x in rank) for rank in per_worker.stage_actions))
    step = predict(layout.strategy, per_worker, cluster, layout.dp * share, **layout.options)
    in_flight = layout.pp if layout.pp > 1 else 1   # 1F1B holds up to p micro-batches at the first stage
    samples = workload.batch_per_device / (layout.microbatches or 1) * in_flight if layout.pp > 1 \
        else workload.batch_per_device
    layers = (workload.layers or 1) / layout.pp
    state = memory.state_bytes(layout.strategy, workload.params, optimizer_bytes, layout.dp * share, layout.pp,
                               layout.tp, layout.compression)
    if footprint:
        share_of_model = samples / footprint.batch * layers / (workload.layers or 1) / layout.tp
        return step, footprint.peak(state, footprint.activations * share_of_model, layout.tp)
    return step, state + memory.activation_bytes(workload, samples, heads, layers) / layout.tp


def memory_here(model, workload, optimizer_bytes):
    """The Footprint of built-in ``model`` measured here (simulate/footprint.py), for this
    machine's predictions; None where the heap cannot be read."""
    from .footprint import footprint
    one = memory.state_bytes("dp", workload.params, optimizer_bytes, 1)
    return footprint(model, workload.batch_per_device, one)


def rank(model, workers, cluster, memory_gb=None, batch_size=None, common=None):
    """[(Layout, Step, bytes held)] best first, and [(Layout, why not)] for the rest."""
    from ..compare.strategies import refused
    beside = alongside(cluster, workers)
    K, heads = _optimizer_and_heads(model)
    common = common or ["--model", model, "--workers", str(workers)]
    ranked, dropped = [], []
    with timing.standing():   # the parts timed one after another, beside the same neighbours
        workload = here.workload_of(model, batch_size, alongside=beside)
        measured_memory = memory_here(model, workload, K) if cluster.cores else None
        for layout in layouts(workers, workload.layers):
            why = refused([*common, *layout.flags])
            step, held = (None, None) if why else predicted(layout, workload, cluster, K, heads,
                                                            here.Measured(model, alongside=beside), measured_memory)
            if why or isinstance(step, Unavailable):
                dropped.append((layout, why or str(step)))
            elif memory_gb and held > memory_gb * 2 ** 30:
                dropped.append((layout, f"predicted {held / 2 ** 30:.2f} GiB a worker, "
                                        f"over --memory-gb {memory_gb:g}"))
            else:
                ranked.append((layout, step, held))
    return best_first(ranked), dropped


def best_first(ranked):
    """[(Layout, Step, bytes held)] by predicted samples per second (step times of different
    batches do not compare), and of two equally fast, the one that holds less first: a
    layout's memory is its headroom for a larger batch or model (ZeRO-1 and 2 move the same
    bytes when the gradients fit one bucket, and 2 holds less). Equal to nine digits: the
    two stages' sums, added in another order, differ in their last bits."""
    return sorted(ranked, key=lambda r: (-float(f"{r[1].samples_per_s:.9g}"), r[2]))


def command_line(model, workers, layout):
    return " ".join(["paratrain train", "--model", model, "--workers", str(workers), *layout.flags])


def row(model, workers, layout, step, held):
    return {"strategy": layout.strategy, "command": command_line(model, workers, layout),
            "dp": layout.dp, "pp": layout.pp, "tp": layout.tp, "microbatches": layout.microbatches,
            "compression": layout.compression,
            "predicted_step_ms": step.step_s * 1e3, "predicted_samples_per_s": step.samples_per_s,
            "predicted_memory_mb": held / memory.MB, "how": step.how}
