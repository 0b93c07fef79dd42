"""``--strategy pipeline``: the model cut between layers into ``--stages`` stages,
micro-batches flowing through them (parallel/pipeline/).

With ``--workers`` a multiple of ``--stages``, consecutive ranks form one
pipeline (ranks 0..s-1, s..2s-1, ...) and the pipelines are data-parallel
replicas of each other (each reads its own shard, every stage's gradients are
averaged over its replicas). The cut is balanced by forward+backward time
measured on a micro-batch of the training data. Each worker steps an
optimizer over its own stage only.

Evaluation runs the eval set through the pipeline (forward only) on every
worker; checkpoints are one file per stage (``checkpoint.pt`` holds stage
0, ``checkpoint.stage1.pt`` stage 1, ...), written by the first replica and
read back by every replica of that stage, so resuming is exact. At the end,
``timeline.png`` in the run directory shows the last step's F / B / W boxes
per stage, with the bubble measured against the schedule's formula.
"""
import json
import os

import torch
from torch import nn

import paratrain as pt

from ...comm.world import broadcast_text, elastic_generation
from ...parallel.data import CommStats
from ...parallel.pipeline import schedules, timeline
from ..argtypes import positive_int
from ..optimizer import make_optimizer
from .base import GroupStep, LastStepTraffic

HELP = "pipeline: the model cut between layers into --stages stages, micro-batches through a --schedule"
SPARSE = False
CUTS = {"pipeline": ("pp", "tp")}   # --pp N (N > 1) is this strategy with N stages; --tp cuts each stage (3D)
ELASTIC = ("pipeline",)   # --min-workers: a lost worker takes its replica out (elastic_loop.py)
CUTTABLE = ("digits", "gpt", "mlp", "mlp-large", "hf-gpt2", "hf-bert", "hf-llama")
DEFAULT_STAGES = 2


def add_options(parser):
    g = parser.add_argument_group("--strategy pipeline")
    g.add_argument("--stages", type=positive_int, default=None, help="pipeline stages, one per worker (default 2)")
    g.add_argument("--microbatches", type=positive_int, default=None,
                   help="micro-batches per batch (default 4; the batch must be a multiple)")
    g.add_argument("--schedule", choices=schedules.SCHEDULES, default=None, help="pipeline schedule (default 1f1b)")
    g.add_argument("--virtual", type=positive_int, default=None,
                   help="stages per worker for --schedule interleaved (default 2)")


def stages(args):
    """How many stages the options ask for (--stages, which --pp sets)."""
    return args.stages or DEFAULT_STAGES


def take_pp(args, pp):
    """``--pp N``, the layout's name for --stages N (layout.py): what is wrong, or None."""
    if args.stages is not None and args.stages != pp:
        return f"--pp {pp} and --stages {args.stages} disagree; give one of them"
    args.stages = pp
    return None


def check(args, chosen):
    given = [f for f in ("stages", "microbatches", "schedule", "virtual") if getattr(args, f) is not None]
    if not chosen:
        return f"--{given[0]} is for --strategy pipeline" if given else None
    if args.model not in CUTTABLE:
        return f"--strategy pipeline cuts the {', '.join(CUTTABLE)} models, not {args.model}"
    n = stages(args)
    if args.workers % (n * args.tp):
        of = f"--stages {n}" if args.tp == 1 else f"--stages x --tp = {n * args.tp}"
        return f"--workers {args.workers} is not a multiple of {of} (each pipeline needs {n * args.tp} workers)"
    if args.sequence_parallel:   # (--tp cuts each stage's layers, but not its tokens)
        return "--sequence-parallel is for --strategy allreduce (not with a pipeline yet)"
    if args.virtual and args.virtual > 1 and (args.schedule or "1f1b") != "interleaved":
        return "--virtual is for --schedule interleaved"
    return None


def launcher_args(args):
    return []


SUMMARY = {
    "backend": lambda step, args: step.group.backend,
    "pipeline_stages": lambda step, args: step.stages,
    "pipeline_replicas": lambda step, args: step.data_replicas,
    "pipeline_schedule": lambda step, args: f"{step.pipe.schedule}, {step.pipe.m} micro-batches"
                                            + (f", {step.stage.virtual} stages per worker" if step.stage.virtual > 1 else ""),
    "pipeline_bubble": lambda step, args: step.bubble,
    "pipeline_bubble_formula": lambda step, args: step.bubble_formula,
    "pipeline_parameters_per_stage": lambda step, args: step.params_per_stage,
    "tensor_parallel": lambda step, args: step.tp,
    # with --tp: rank 0's stage, the last step (pt.tensor.traffic), and over that stage's transformer blocks
    "tensor_parallel_bytes_per_step": lambda step, args: step.traffic.bytes,
    "tensor_parallel_bytes_per_layer": lambda step, args: step.traffic.per_layer(step.blocks_held),
    "pipeline_timeline": lambda step, args: step.timeline_png,
}


class PipelineStep(GroupStep):
    def __init__(self, task, args, settings):
        world = pt.init(backend=args.backend)
        self.group = world
        self.rank, self.world_size = world.rank, world.world_size
        self.stages, self.tp, self.traffic = stages(args), args.tp, LastStepTraffic(args.tp)
        replicas = self.world_size // (self.stages * self.tp)
        self.mesh = pt.mesh(dp=replicas, pp=self.stages, tp=self.tp)
        self.pipe_group = self.mesh["pp"]
        self.dp_group = self.mesh["dp"] if replicas > 1 else None
        self.replicas, self.replica = replicas, self.mesh.coords["dp"]
        m = args.microbatches or 4
        schedule = args.schedule or "1f1b"
        virtual = args.virtual or (2 if schedule == "interleaved" else 1)
        sample = _sample_inputs(task, max(1, settings.batch_size // m))
        # one cut for every pipeline (replicas and tensor-parallel ranks alike), timed on the whole
        # model on rank 0; then each layer is cut inside across --tp, then the model between layers
        points = self._saved_cut(task, args, self.stages * virtual)
        if points is None and elastic_generation()[1]:   # a re-formed world: the cut the job runs with, rank 0's
            mine = json.dumps(getattr(args, "elastic_cut", None)) if self.rank == 0 else None
            points = json.loads(broadcast_text(world, mine, 0))
        if points is None:
            points = pt.pipeline.choose_cut(task.model, self.stages, sample=sample, virtual=virtual, group=world,
                                            verbose=self.rank == 0)
        self.cut = args.elastic_cut = points
        if self.tp > 1:
            pt.tensor.parallelize(task.model, group=self.mesh["tp"], plan=task.tensor_plan(task.model))
        self.names = {}   # every name of each parameter: a tied weight is saved under all of them, as one process does
        for n, q in task.model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(q), []).append(n)
        self.blocks_path = task.blocks
        self.stage = pt.pipeline.split(task.model, group=self.pipe_group, virtual=virtual, split_points=points,
                                       sample=sample, verbose=self.rank == 0)
        self.pipe = pt.Pipeline(self.stage, group=self.pipe_group, microbatches=m, schedule=schedule,
                                loss_fn=self._weighted_loss(task), dp_group=self.dp_group)
        self.model = self.stage
        self.opt = make_optimizer(settings.optimizer, self.stage.parameters(), settings.lr)
        self.stats = CommStats()
        self.run_dir = args.run_dir
        self.bubble = self.bubble_formula = self.timeline_png = None
        counts = torch.zeros(self.world_size, dtype=torch.int64)
        mine = torch.tensor([sum(q.numel() for q in self.stage.parameters())], dtype=torch.int64)
        world.all_gather(counts, mine)   # per worker: with --tp, each holds its slices of its stage
        self.params_per_stage = [int(counts[self.mesh.rank_at(pp=k)]) for k in range(self.stages)]

    def _weighted_loss(self, task):
        """The task's loss times ``loss_weight`` (elastic: a replica's share of the step's batch)."""
        loss_of = _loss_of(task)
        return lambda output, target: self._weighted(loss_of(output, target))

    # ---- elastic (--min-workers): this worker's part of its replica, built again in a new world ----

    def elastic_replica(self):
        return pt.elastic.Replica(self.stage, self.opt, self.mesh["dp"])

    def param_groups(self):
        return self.opt.param_groups

    def regrouped(self, group):
        pass   # built again in the new world (pt.elastic.Rebuilt)

    def zero_grad(self):
        self.opt.zero_grad()

    def _held_names(self):
        """The names of the parameters this worker's stage holds (a tied weight's every name)."""
        return [n for q in self.stage.parameters() for n in self.names[id(q)]]

    def _saved_cut(self, task, args, total):
        """On a resume, the cut the checkpoint was written with (when it has as many stages):
        a cut chosen by measured time may fall elsewhere on another run, and each stage's
        file holds only its own layers."""
        if not args.resume:
            return None
        from ..checkpoint import load_checkpoint
        saved = load_checkpoint(self.checkpoint_path(args.resume, writing=False), task.config).get("pipeline_cut")
        return list(saved) if saved is not None and len(saved) == total - 1 else None

    @property
    def data_replicas(self):
        return self.replicas

    @property
    def data_rank(self):
        return self.replica

    def blocks_held(self):
        """How many of the model's transformer blocks this worker's stage holds."""
        prefix = f"{self.blocks_path}."
        return len({name[len(prefix):].split(".")[0] for name in self._held_names()
                    if self.blocks_path and name.startswith(prefix)})

    def forward_backward(self, task, batch):
        x, y = batch
        loss = self.pipe.step(x if self.stage.is_first else None, y if self.stage.is_last else None)
        self.stats.bytes += self.pipe.sent_bytes   # activations and gradients sent to the neighbours
        self.stats.blocked(self.pipe.waited_seconds)
        self.traffic.count_blocked(self.stats)   # with --tp, its stages' collectives
        return loss

    def before_step(self):
        self.traffic.start()

    def after_backward(self):
        self.traffic.stop()
        self.opt.step()
        self.opt.zero_grad()

    def logged_loss(self, loss):
        return float(loss)   # the whole batch's, the same on every worker: nothing to average

    def evaluate(self, task):
        result = task.evaluate(_ThroughPipeline(self.pipe))
        return result if self.rank == 0 else None

    # ---- checkpoints: one file per stage ---------------------------------------------------------

    def checkpoint_path(self, path, writing):
        """One file per stage, written by the first replica's first tensor-parallel worker
        (with --tp the stage is gathered whole first), read by every worker of that stage."""
        if writing and (self.replica != 0 or self.mesh.coords["tp"] != 0):
            return None
        k = self.mesh.coords["pp"]
        if k == 0:
            return path
        root, ext = os.path.splitext(path)
        return f"{root}.stage{k}{ext}"

    def model_state(self, task):
        mine = set(self._held_names())
        if self.tp > 1:   # collective over the tensor-parallel group: every worker calls it
            return {k: v for k, v in pt.tensor.full_state_dict(task.model).items() if k in mine}
        return {n: q.detach().clone() for q in self.stage.parameters() for n in self.names[id(q)]}

    def load_model_state(self, task, state):
        mine = set(self._held_names())
        if set(state) != mine:
            raise ValueError(f"this checkpoint holds {len(state)} tensors of another stage or cut than stage "
                             f"{self.mesh.coords['pp']}'s {len(mine)}: resume with the same --stages")
        if self.tp > 1:
            pt.tensor.load_full_state_dict(task.model, state, strict=False)
        else:
            task.model.load_state_dict(state, strict=False)

    def state_dict(self):
        if self.tp > 1:   # gathered whole, as the stage's parameters are
            return {"optimizer": pt.tensor.full_optimizer_state(self.stage, self.opt), "pipeline_cut": self.cut}
        return {"optimizer": self.opt.state_dict(), "pipeline_cut": self.cut}

    def load_state_dict(self, state):
        if self.tp > 1:
            pt.tensor.load_full_optimizer_state(self.stage, self.opt, state["optimizer"])
        else:
            self.opt.load_state_dict(state["optimizer"])

    # ---- the end: the last step's timeline -------------------------------------------------------

    def finish(self):
        if not self.pipe.timeline:
            return
        timelines = timeline.gather(self.pipe_group, self.pipe.timeline)
        self.bubble = timeline.bubble(timelines)
        p, m, v = self.stages, self.pipe.m, self.stage.virtual
        self.bubble_formula = schedules.bubble_formula(self.pipe.schedule, p, m, v)
        if self.rank == 0 and self.run_dir:
            title = (f"{self.pipe.schedule}, {p} stages, {m} micro-batches: bubble {self.bubble:.1%} measured, "
                     f"{self.bubble_formula:.1%} by the formula (last step)")
            self.timeline_png = timeline.plot(timelines, os.path.join(self.run_dir, "timeline.png"), title)
            with open(os.path.join(self.run_dir, "timeline.json"), "w") as f:
                json.dump({"title": title, "stages": timelines}, f)


class _ThroughPipeline(nn.Module):
    """What task.evaluate calls as the model: the whole pipeline, forward only."""

    def __init__(self, pipe):
        super().__init__()
        self.pipe = pipe
        self.stage = pipe.stage

    def forward(self, x):
        return self.pipe.forward(x)


def _loss_of(task):
    """loss_fn(output, target) from the task's loss(model, batch): the task's loss with
    the output standing in for the model's answer (it calls the model once)."""
    return lambda output, target: task.loss(lambda _: output, (None, target))


def _sample_inputs(task, n):
    """A micro-batch of the training inputs, for timing the layers."""
    return torch.stack([task.train_set[i][0] for i in range(min(n, len(task.train_set)))])


def make_step(task, args, settings):
    return PipelineStep(task, args, settings)
