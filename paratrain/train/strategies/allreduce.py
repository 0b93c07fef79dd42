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

from ...parallel.compression import Compressor
from ...parallel.compression import checkpoint as compression_checkpoint
from ...parallel.zero.memory import optimizer_tensors
from ..coordination import GroupBoard, Lockstep
from .base import LastStepTraffic, ReplicaStep
from ..options import positive_float, positive_int

HELP = ("allreduce: bucketed DataParallel (overlapped where that pays); allreduce-naive: every gradient "
        "all-reduced after backward (DataParallelNaive)")
SPARSE = False
ALGORITHMS = ("direct", "ring", "tree", "naive")
COMPRESSIONS = ("none", "fp16", "bf16", "topk:<ratio>", "powersgd:<rank>", "onebit")


def compression_spec(text):
    import argparse
    kind, _, arg = text.partition(":")
    if text in ("none", "fp16", "bf16", "onebit"):
        return text
    if kind == "topk":
        try:
            ratio = float(arg or 0.01)
        except ValueError:
            ratio = -1
        if 0 < ratio <= 1:
            return f"topk:{ratio}"
        raise argparse.ArgumentTypeError(f"{text!r}: topk takes the fraction of entries sent, in (0, 1], "
                                         "e.g. topk:0.01")
    if kind == "powersgd":
        if (arg or "4").isdigit() and int(arg or 4) >= 1:
            return f"powersgd:{int(arg or 4)}"
        raise argparse.ArgumentTypeError(f"{text!r}: powersgd takes the rank, a positive integer, e.g. powersgd:4")
    raise argparse.ArgumentTypeError(f"unknown compression {text!r}; choose {', '.join(COMPRESSIONS)}")


def add_options(parser):
    g = parser.add_argument_group("--strategy allreduce, allreduce-naive")
    g.add_argument("--algorithm", default=None,
                   help="all-reduce algorithm: direct (shm default), ring, tree, naive (gather to rank 0 "
                        "and back)")
    g.add_argument("--bucket-mb", type=positive_float, default=25.0, help="gradient bucket size in MB (allreduce; default 25)")
    g.add_argument("--compression", type=compression_spec, default="none",
                   help="how gradient buckets (allreduce) or pushes (ps: not powersgd) travel: none, fp16 / bf16 (cast), topk:<ratio> (the "
                        "largest entries, error feedback; e.g. topk:0.01), powersgd:<rank> (low-rank, e.g. powersgd:4), "
                        "onebit (scaled signs, error feedback)")
    g.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel size: each model cut across this many workers (gpt; default 1); "
                        "--workers / --tp replicas average their gradients; with --strategy pipeline, each stage "
                        "cut so (3D)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: LayerNorms and residuals on 1/tp of the tokens each (Korthikanti et al.)")


def check(args, chosen):
    """Only DataParallel's names are checked here: DataParallelNaive, and any other
    strategy given --algorithm, pass it on as it is (as they always have)."""
    if args.compression != "none" and args.strategy not in ("allreduce", "ps", "zero"):
        return (f"--compression is for --strategy allreduce (gradient buckets) and ps (pushes), not "
                f"{args.strategy}")
    if chosen and args.strategy == "allreduce" and args.algorithm and args.algorithm not in ALGORITHMS:
        return f"unknown --algorithm {args.algorithm!r}; choose direct, ring, tree or naive"
    if args.tp > 1:   # --tp is also the pipeline's (3D: strategies/pipeline.py checks its own multiple)
        if args.strategy not in ("allreduce", "pipeline"):
            return "--tp is for --strategy allreduce or pipeline"
        if args.workers % args.tp:
            return f"--workers {args.workers} is not a multiple of --tp {args.tp}"
        from ..tasks import build_task
        task = build_task(args.model, seed=args.seed)
        if task.tensor_plan is None:
            return f"--tp cuts a transformer (gpt, hf-gpt2, hf-bert, hf-llama: each has a tensor-parallel plan), not {args.model}"
        try:   # widths, vocabulary and heads --tp must divide, before any worker starts
            pt.tensor.check_plan(task.model, task.tensor_plan(task.model), args.tp)
        except ValueError as e:
            return f"--tp {args.tp}: {e}"
    elif args.sequence_parallel:
        return "--sequence-parallel cuts the tokens among tensor-parallel workers; give --tp 2 or more"
    return None


def launcher_args(args):
    return []


SUMMARY = {
    "backend": lambda step, args: step.group.backend,
    "algorithm": lambda step, args: args.algorithm or "default",
    "compression": lambda step, args: step.compression,
    "tensor_parallel": lambda step, args: step.tp,
    "sequence_parallel": lambda step, args: args.sequence_parallel if step.tp > 1 else None,
    "parameter_bytes_per_worker": lambda step, args: sum(q.numel() * q.element_size() for q in step.model.parameters()),
    "optimizer_bytes_per_worker": lambda step, args: sum(v.numel() * v.element_size()
                                                         for v in optimizer_tensors(step.opt)),
    # with --tp: what the cut layers' collectives moved in the last step (pt.tensor.traffic), by kind,
    # and per transformer block (the step's bytes over the blocks; the token embedding's share included)
    "tensor_parallel_bytes_per_step": lambda step, args: step.traffic.bytes,
    "tensor_parallel_bytes_per_layer": lambda step, args: step.traffic.per_layer(lambda: step.blocks),
}


SGD_MOMENTUM = 0.9


def make_optimizer(name, params, lr, momentum=SGD_MOMENTUM):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose sgd or adam")


class AllReduceStep(ReplicaStep):
    """DataParallel (or the naive version) with an optimizer in every worker: the
    gradients are averaged during backward, then each worker steps alike."""

    local_loss = False             # logged_loss is already the mean over the workers
    finish_changes_weights = False

    def __init__(self, task, args, group, optimizer, lr):
        module = task.model
        self.tp, self.mesh, replicas, self.traffic = args.tp, None, group, LastStepTraffic(args.tp)
        self.blocks = len(module.get_submodule(task.blocks)) if task.blocks else 0
        if self.tp > 1:   # tensor parallel inside each replica, data parallel between them
            self.mesh = pt.mesh(dp=group.world_size // self.tp, tp=self.tp)
            pt.tensor.parallelize(module, group=self.mesh["tp"], plan=task.tensor_plan(module),
                                  sequence_parallel=args.sequence_parallel)
            replicas = self.mesh["dp"]
        compression, momentum = None if args.compression == "none" else args.compression, SGD_MOMENTUM
        self.compression = compression
        if optimizer == "sgd":
            # top-k: DGC's momentum correction (compression/topk.py), SGD's momentum moved into the
            # compressor, before the sparsification: with momentum applied after top-k, the rarely
            # sent entries get theirs late and mlp-large ends points behind uncompressed (README)
            from ...parallel.compression import with_sgd_momentum
            compression, momentum = with_sgd_momentum(compression, SGD_MOMENTUM)
            if momentum != SGD_MOMENTUM:
                self.compression += (" (DGC momentum correction: SGD's momentum in the compressor; "
                                     f"density warm-up over {compression.warmup_steps} steps)")
        if args.strategy == "allreduce":
            self.model = pt.DataParallel(module, group=replicas, bucket_mb=args.bucket_mb, algorithm=args.algorithm,
                                         compression=compression)
        else:
            self.model = pt.DataParallelNaive(module, group=replicas, algorithm=args.algorithm)
        self.group = group
        self.rank, self.world_size = group.rank, group.world_size
        self.opt = make_optimizer(optimizer, self.model.parameters(), lr, momentum)
        self.stats = self.model.stats
        self._loss = torch.zeros(1, dtype=torch.float64)

    def coordination(self, settings, start):
        return GroupBoard(self.group), Lockstep(settings.steps, start)

    def before_step(self):
        self.traffic.start()

    def after_backward(self):
        self.traffic.stop()
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

    # ---- with --tp: data shards per replica, evaluation and checkpoints through every cut model ----

    @property
    def data_replicas(self):
        return self.world_size // self.tp

    @property
    def data_rank(self):
        return self.mesh.coords["dp"] if self.mesh else self.rank

    def evaluate(self, task):
        if self.tp == 1:
            return super().evaluate(task)
        result = task.evaluate(task.model)   # every rank: the cut model's forward is collective
        return result if self.rank == 0 else None

    def model_state(self, task):
        """The whole model; with --tp gathered from the cut layers (one process's names and
        shapes), so the checkpoint loads at any --tp or in one process."""
        return pt.tensor.full_state_dict(task.model) if self.tp > 1 else task.model.state_dict()

    def load_model_state(self, task, state):
        if self.tp > 1:
            pt.tensor.load_full_state_dict(task.model, state)
        else:
            task.model.load_state_dict(state)

    def state_dict(self):
        """The optimizer's state (momentum, Adam's moments): with it a resumed run
        continues exactly where the stopped one was. With --tp it is gathered whole, as
        the model is (collective: every worker calls this), so it resumes at any --tp."""
        if self.tp == 1:
            state = {"optimizer": self.opt.state_dict()}
        else:
            state = {"optimizer": pt.tensor.full_optimizer_state(self.model.module, self.opt)}
        if self._compressor() is not None:   # every worker's residuals (collective; compression/checkpoint.py)
            state["compression"] = compression_checkpoint.gather(self.group, self._compressor())
        return state

    def _compressor(self):
        hook = getattr(self.model, "hook", None)
        return hook if isinstance(hook, Compressor) else None

    def load_state_dict(self, state):
        if state.get("optimizer") is None:   # written by a --tp run before optimizer states were gathered
            if self.rank == 0:
                print("[train] this checkpoint holds no optimizer state: the optimizer starts afresh", flush=True)
            return
        if self.tp == 1:
            self.opt.load_state_dict(state["optimizer"])
        else:
            pt.tensor.load_full_optimizer_state(self.model.module, self.opt, state["optimizer"])
        self._load_compressor_state(state.get("compression"))

    def _load_compressor_state(self, saved):
        compressor, note = self._compressor(), None
        if compressor is not None and saved is not None:
            note = compression_checkpoint.restore(compressor, saved, self.rank, self.world_size)
        elif compressor is not None:
            note = "this checkpoint holds no compressor state: the residuals start at zero"
        elif saved is not None:
            note = (f"this checkpoint holds a {saved['kind']} compressor's residuals, which this run (no such "
                    "--compression) does not use")
        if note and self.rank == 0:
            print(f"[train] {note}", flush=True)


def make_step(task, args, settings):
    group = pt.init(backend=args.backend)
    return AllReduceStep(task, args, group, settings.optimizer, settings.lr)
