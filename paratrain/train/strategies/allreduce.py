"""``--strategy allreduce`` and ``allreduce-naive``: data parallelism, an optimizer in every worker.

The gradients are averaged among the workers during backward (DataParallel:
bucketed, overlapped where that pays) or after it (DataParallelNaive: every
gradient on its own), then every worker steps its own optimizer alike, so the
replicas stay equal. The workers move in lockstep, and their end-of-run
reports travel through the same process group (coordination.GroupBoard).
"""
import paratrain as pt

from ...parallel.compression import Compressor, with_sgd_momentum
from ...parallel.compression import checkpoint as compression_checkpoint
from ...parallel.zero.memory import optimizer_tensors
from ..argtypes import positive_float
from ..optimizer import SGD_MOMENTUM, make_optimizer
from .base import GroupStep, LastStepTraffic

HELP = ("allreduce: bucketed DataParallel (overlapped where that pays); allreduce-naive: every gradient "
        "all-reduced after backward (DataParallelNaive)")
SPARSE = False
CUTS = {"allreduce": ("tp",)}   # DataParallel's replicas may each be cut across --tp; the naive one's not
COMPRESSES = {"allreduce": "gradient buckets"}
ELASTIC = ("allreduce", "allreduce-naive")   # --min-workers: the wrappers re-form over a new world (with --tp:
                                             # each replica is built again there, elastic_loop.py)
ALGORITHMS = ("direct", "ring", "tree", "naive")


def add_options(parser):
    g = parser.add_argument_group("--strategy allreduce, allreduce-naive")
    g.add_argument("--algorithm", default=None,
                   help="all-reduce algorithm: direct (shm default), ring, tree, naive (gather to rank 0 "
                        "and back)")
    g.add_argument("--bucket-mb", type=positive_float, default=25.0, help="gradient bucket size in MB (allreduce; default 25)")


def check(args, chosen):
    """Only DataParallel's names are checked here: DataParallelNaive, and any other
    strategy given --algorithm, pass it on as it is."""
    if chosen and args.strategy == "allreduce" and args.algorithm and args.algorithm not in ALGORITHMS:
        return f"unknown --algorithm {args.algorithm!r}; choose direct, ring, tree or naive"
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


class AllReduceStep(GroupStep):
    """DataParallel (or the naive version) with an optimizer in every worker: the
    gradients are averaged during backward, then each worker steps alike."""

    def __init__(self, task, args, group, optimizer, lr, steps=None):
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
            # sent entries get theirs late, and the run falls behind an uncompressed one
            compression, momentum = with_sgd_momentum(compression, SGD_MOMENTUM, run_steps=steps)
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

    def before_step(self):
        self.traffic.start()

    def forward_backward(self, task, batch):
        loss = super().forward_backward(task, batch)
        self.traffic.count_blocked(self.stats)   # with --tp, the cut layers' collectives
        return loss

    # ---- elastic (--min-workers): what a commit holds, and going on in a new world ----

    def elastic_parts(self):
        """(model, optimizer) for pt.elastic.State: the wrapper, which re-forms over a new world."""
        return self.model, self.opt

    def elastic_replica(self):
        """With --tp: this worker's part of its replica, for pt.elastic.Rebuilt (built again in a new world)."""
        return pt.elastic.Replica(self.model, self.opt, self.mesh["dp"])

    def param_groups(self):
        return self.opt.param_groups

    def regrouped(self, group):
        """pt.elastic moved the wrapper to ``group`` (a worker lost or joined): go on in it."""
        self.group, self.rank, self.world_size = group, group.rank, group.world_size

    def zero_grad(self):
        self.opt.zero_grad()

    def after_backward(self):
        self.traffic.stop()
        self.opt.step()
        self.opt.zero_grad()   # gradients to None: the cheaper way into the buckets (DataParallel.zero_grad)

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
        if state.get("optimizer") is None:   # a checkpoint that holds the model alone
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
    return AllReduceStep(task, args, group, settings.optimizer, settings.lr, settings.steps)
