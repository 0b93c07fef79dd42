"""``--strategy allreduce`` and ``allreduce-naive``: data parallelism, an optimizer in every worker.

The gradients are averaged among the workers during backward (DataParallel:
bucketed, overlapped where that pays) or after it (DataParallelNaive: every
gradient on its own), then every worker steps its own optimizer alike, so the
replicas stay equal. The workers move in lockstep, and their end-of-run
reports travel through the same process group (coordination.GroupBoard).
"""
import time

import torch

import paratrain as pt

from ..coordination import GroupBoard, Lockstep
from .base import ReplicaStep
from ..options import positive_float

HELP = ("allreduce: bucketed DataParallel (overlapped where that pays); allreduce-naive: every gradient "
        "all-reduced after backward (DataParallelNaive)")
SPARSE = False
ALGORITHMS = ("direct", "ring", "tree", "naive")
COMPRESSIONS = ("none", "fp16", "bf16")


def add_options(parser):
    g = parser.add_argument_group("--strategy allreduce, allreduce-naive")
    g.add_argument("--algorithm", default=None,
                   help="all-reduce algorithm: direct (shm default), ring, tree, naive (gather to rank 0 "
                        "and back)")
    g.add_argument("--bucket-mb", type=positive_float, default=25.0, help="gradient bucket size in MB (allreduce; default 25)")
    g.add_argument("--compression", choices=COMPRESSIONS, default="none",
                   help="cast buckets to fp16/bf16 for the all-reduce (allreduce)")


def check(args, chosen):
    """Only DataParallel's names are checked here: DataParallelNaive, and any other
    strategy given --algorithm, pass it on as it is (as they always have)."""
    if chosen and args.strategy == "allreduce" and args.algorithm and args.algorithm not in ALGORITHMS:
        return f"unknown --algorithm {args.algorithm!r}; choose direct, ring, tree or naive"
    return None


def launcher_args(args):
    return []


SUMMARY = {
    "backend": lambda step, args: step.group.backend,
    "algorithm": lambda step, args: args.algorithm or "default",
}


def make_optimizer(name, params, lr):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose sgd or adam")


class AllReduceStep(ReplicaStep):
    """DataParallel (or the naive version) with an optimizer in every worker: the
    gradients are averaged during backward, then each worker steps alike."""

    local_loss = False             # logged_loss is already the mean over the workers
    finish_changes_weights = False

    def __init__(self, module, args, group, optimizer, lr):
        if args.strategy == "allreduce":
            self.model = pt.DataParallel(module, group=group, bucket_mb=args.bucket_mb, algorithm=args.algorithm,
                                         compression=None if args.compression == "none" else args.compression)
        else:
            self.model = pt.DataParallelNaive(module, group=group, algorithm=args.algorithm)
        self.group = group
        self.rank, self.world_size = group.rank, group.world_size
        self.opt = make_optimizer(optimizer, self.model.parameters(), lr)
        self.stats = self.model.stats
        self._loss = torch.zeros(1, dtype=torch.float64)

    def coordination(self, settings, start):
        return GroupBoard(self.group), Lockstep(settings.steps, start)

    def before_step(self):
        pass

    def after_backward(self):
        self.opt.step()
        self.opt.zero_grad()   # gradients to None: the cheaper way into the buckets (DataParallel.zero_grad)

    def logged_loss(self, loss):
        self._loss[0] = loss.item()
        t0 = time.perf_counter()
        self.group.all_reduce(self._loss, op="avg")  # the loss over every worker's batch, not rank 0's alone
        # Counted as waiting: when a worker is slower after backward (a --straggler sleeps
        # there, slowdown.py), this is where the others wait for it.
        dt = time.perf_counter() - t0
        self.stats.wait_seconds += dt
        self.stats.comm_seconds += dt
        return float(self._loss[0])

    def finish(self):
        pass

    def state_dict(self):
        """The optimizer's state (momentum, Adam's moments): with it a resumed run
        continues exactly where the stopped one was."""
        return {"optimizer": self.opt.state_dict()}

    def load_state_dict(self, state):
        self.opt.load_state_dict(state["optimizer"])


def make_step(task, args, settings):
    group = pt.init(backend=args.backend)
    return AllReduceStep(task.model, args, group, settings.optimizer, settings.lr)
