"""``--strategy zero``: data parallelism with its redundancy removed (pt.ZeRO, parallel/zero/).

Every worker reads its own shard of the data, as with allreduce; what differs
is what each holds: with ``--stage 1`` the optimizer's state is cut among the
workers, with ``--stage 2`` the gradients too, with ``--stage 3`` the
parameters too (gathered layer by layer around its forward and backward).
The summary shows the bytes each worker held after the last backward,
measured, beside the ZeRO paper's formula.

Checkpoints (``--checkpoint-format``):

- ``full`` (the default) holds the whole model and the whole optimizer state
  (gathered: what one process's optimizer over the model would hold), in
  ``checkpoint.pt``, so a run resumes exactly at another --workers, --stage
  or --strategy allreduce, or in one process;
- ``sharded``: each worker writes its own chunks and their optimizer state,
  worker 0 to ``checkpoint.pt`` and worker r to ``checkpoint.rank<r>.pt``,
  at once, nothing gathered (the fast one, as
  FSDP's sharded state dict); it resumes exactly at the same --workers and
  --stage only, and says so otherwise.

A resume reads whichever the run directory holds.
"""
import contextlib
import os

import torch

import paratrain as pt

from ...parallel.data import CommStats
from ..optimizer import FUSED, optimizer_class
from .base import GroupStep

HELP = ("zero: data parallelism with the optimizer state (--stage 1), the gradients (2) and the parameters "
        "(3) cut among the workers (pt.ZeRO)")
SPARSE = False
DEFAULT_STAGE = 2   # the paper's P_os+g: a quarter of the memory at DP's communication volume
ELASTIC = ("zero",)   # --min-workers: each shard committed with a copy on the next worker (zero/elastic.py)


def add_options(parser):
    g = parser.add_argument_group("--strategy zero")
    g.add_argument("--stage", type=int, choices=(1, 2, 3), default=None,
                   help=f"what is cut: 1 optimizer state, 2 and gradients, 3 and parameters (default {DEFAULT_STAGE})")
    g.add_argument("--checkpoint-format", choices=("full", "sharded"), default=None,
                   help="full: the whole model and optimizer state in checkpoint.pt, resumable at any --workers "
                        "(default); sharded: each worker its own part (checkpoint.pt, checkpoint.rank<r>.pt), nothing gathered, "
                        "resumable at the same --workers and --stage")


def check(args, chosen):
    if not chosen:
        if args.checkpoint_format is not None:
            return "--checkpoint-format is for --strategy zero"
        return "--stage is for --strategy zero" if args.stage is not None else None
    if args.compression != "none":
        return "--compression is for --strategy allreduce (ZeRO's reduce-scatters are not compressed)"
    return None


def launcher_args(args):
    return []


def formula(stage, P, N):
    """Bytes a worker holds for P fp32 parameters and Adam (K = 8) over N workers
    (Rajbhandari et al., arXiv 1910.02054, sec. 5.1, fig. 1)."""
    return {1: (4 + 4) * P + 8 * P / N, 2: 4 * P + 12 * P / N, 3: 16 * P / N}[stage]


SUMMARY = {
    "backend": lambda step, args: step.group.backend,
    "zero_stage": lambda step, args: step.engine.stage,
    "zero_bytes_per_worker": lambda step, args: step.held,
    "zero_bytes_formula": lambda step, args: (round(formula(step.engine.stage, step.numel, step.world_size))
                                              if step.adam else None),
}


class ZeroStep(GroupStep):
    """Data parallelism's step with pt.ZeRO in place of DataParallel and the optimizer."""

    def __init__(self, task, args, settings):
        group = pt.init(backend=args.backend)
        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        cls, kwargs = optimizer_class(settings.optimizer, settings.lr)
        self.engine = pt.ZeRO(task.model, cls, stage=args.stage or DEFAULT_STAGE, group=group, **kwargs, **FUSED)
        self.model, self.adam = self.engine, cls is torch.optim.Adam
        self.numel = sum(q.numel() for q in task.model.parameters())
        self.stats, self.held, self._moved = CommStats(), None, 0
        self.sharded = args.checkpoint_format == "sharded"

    def forward_backward(self, task, batch):
        """The step's forward and backward; the time they were blocked in the engine's
        collectives (stage 2's and 3's reduce-scatters, stage 3's gathers) counted as
        waiting, so the trainer's compute is the compute's alone, as with data parallelism."""
        with self._counting_blocked():
            return super().forward_backward(task, batch)

    @contextlib.contextmanager
    def _counting_blocked(self):
        """What the engine's collectives blocked this rank inside the block, counted as waiting."""
        blocked = self.engine.blocked_seconds()
        yield
        self.stats.blocked(max(0.0, self.engine.blocked_seconds() - blocked))   # (an elastic re-layout starts at 0)

    def after_backward(self):
        """The engine's step: stage 1's reduce-scatters (which wait for the slowest rank, as
        stage 2's do in backward) and stages 1 and 2's all-gathers counted as waiting too."""
        self.held = self.engine.memory()   # the most a step holds outside a stage-3 layer's gather
        with self._counting_blocked():
            self.engine.step()
        self.engine.zero_grad()
        moved = self.engine.bytes_moved()   # (counted from 0 again when an elastic world re-lays it out)
        self.stats.bytes += moved - self._moved if moved >= self._moved else moved
        self._moved = moved

    # ---- elastic (--min-workers) ----

    def elastic_parts(self):
        """(model, optimizer) for pt.elastic.State: the engine commits its shards and their
        optimizer state itself, and is laid out anew over each new world."""
        return self.engine, None

    def param_groups(self):
        return self.engine.optimizer.param_groups

    def regrouped(self, group):
        self.group, self.rank, self.world_size = group, group.rank, group.world_size

    def zero_grad(self):
        self.engine.zero_grad()

    def evaluate(self, task):
        if self.engine.stage < 3:
            return super().evaluate(task)
        result = task.evaluate(task.model)   # every worker: stage 3 gathers each layer collectively
        return result if self.rank == 0 else None

    def checkpoint_path(self, path, writing):
        """Sharded: worker 0 writes ``checkpoint.pt`` and worker r ``checkpoint.rank<r>.pt``
        beside it. On resume, this worker's file if the run directory holds a sharded
        checkpoint, else the full one (``checkpoint.pt``, read by every worker)."""
        full = os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path
        folder = os.path.dirname(full)
        mine = full if self.rank == 0 else os.path.join(folder, f"checkpoint.rank{self.rank}.pt")
        if writing:
            return mine if self.sharded else super().checkpoint_path(path, writing)
        if self.rank == 0 or os.path.isfile(mine):
            return mine
        if os.path.isfile(os.path.join(folder, "checkpoint.rank1.pt")):
            raise ValueError(f"{folder} holds a sharded ZeRO checkpoint written by fewer workers (there is no "
                             f"checkpoint.rank{self.rank}.pt): resume it with the --workers it was written with, "
                             "or write full checkpoints (--checkpoint-format full) to change --workers")
        return full

    def model_state(self, task):
        if self.sharded:
            return self.engine.sharded_state_dict()   # this worker's own chunks: nothing gathered
        return self.engine.full_state_dict()   # stage 3: collective

    def load_model_state(self, task, state):
        if "zero_sharded" in state:
            self.engine.load_sharded_state_dict(state)   # the optimizer's chunks too
        else:
            self.engine.load_full_state_dict(state)

    def state_dict(self):
        if self.sharded:
            return {}   # the optimizer's chunks are in the model's sharded state
        return {"optimizer": self.engine.full_optimizer_state()}   # collective: every worker calls it

    def load_state_dict(self, state):
        if "zero_sharded" in state["model"]:
            return   # load_model_state loaded the optimizer's chunks with the model's
        if state.get("optimizer") is None:
            if self.rank == 0:
                print("[train] this checkpoint holds no optimizer state: the optimizer starts afresh", flush=True)
            return
        self.engine.load_full_optimizer_state(state["optimizer"])


def make_step(task, args, settings):
    return ZeroStep(task, args, settings)
