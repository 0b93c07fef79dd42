"""The options that make ``paratrain train`` elastic: a worker that dies is dropped, a
replacement joins, and the run goes on from its last in-memory commit (pt.elastic).

They go to the launcher as they are (``paratrain run --min-workers ...``), which hosts
the rendezvous and forms each world; the trainer's elastic loop (elastic_loop.py)
commits every ``--commit-every`` steps and deals each step's samples over the world
it is in. Only the strategies whose module says so (``ELASTIC``) can be elastic."""
from . import strategies
from .argtypes import positive_int

BATCH_MODES = ("keep", "shrink")


def add_options(parser):
    g = parser.add_argument_group("elastic training")
    from ..launch.elastic import add_options as add_launcher_options
    add_launcher_options(g, "--workers", replica_flag=False)
    g.add_argument("--elastic-batch", choices=BATCH_MODES, default=None,
                   help="elastic, when the world shrinks: keep the global batch (each worker takes a larger share; "
                        "the default: the run follows the same trajectory), or shrink it (each worker keeps "
                        "--batch-size and the learning rate is scaled by the workers left)")
    g.add_argument("--commit-every", type=positive_int, default=None, metavar="N",
                   help="elastic: commit the state in memory every N steps, the point a failure goes back to "
                        "(default 10)")


def given(args):
    return args.min_workers is not None


def check(args):
    """A message for what is wrong in the elastic options, or None."""
    if not given(args):
        if args.max_workers is not None or args.elastic_timeout is not None or args.max_restarts:
            return "--max-workers, --max-restarts and --elastic-timeout are for an elastic job: give --min-workers too"
        if args.elastic_batch is not None or args.commit_every is not None:
            return "--elastic-batch and --commit-every are for an elastic job: give --min-workers too"
        if any(when != "step" for _, _, when in args.fail):
            return "--fail RANK:STEP:WHEN is for an elastic job (--min-workers); give RANK:STEP"
        return None
    if getattr(args, "budget", None):
        return "a wall-clock budget is not for an elastic job: give --steps"
    from ..launch.elastic import check_sizes
    r = replica_size(args)
    problem = check_sizes(args.min_workers, args.workers, args.max_workers, args.max_restarts,
                          args.elastic_timeout, "--workers", r)
    if problem:
        return problem + ("" if r == 1 else " (a replica: --pp x --tp workers)")
    module = strategies.STRATEGIES[args.strategy]
    if args.strategy not in getattr(module, "ELASTIC", ()):
        able = ", ".join(n for n, m in strategies.STRATEGIES.items() if n in getattr(m, "ELASTIC", ()))
        return (f"--strategy {args.strategy} is not elastic; --min-workers works with {able}"
                + (" (the parameter server under --consistency asp or ssp goes on without a lost worker "
                   "by itself)" if args.strategy == "ps" else ""))
    if r > 1 and args.compression != "none":
        return "--compression with --tp is not elastic yet: drop one of them"
    top, replicas = (args.max_workers or args.workers) // r, args.workers // r
    if args.batch_size is not None and batch_mode(args) == "keep" and args.batch_size * replicas < top:
        return (f"--elastic-batch keep: a global batch of {args.batch_size * replicas} cannot give each of "
                f"{top} replicas a sample; raise --batch-size")
    return None


def launcher_args(args):
    """The launcher's words for an elastic job (none otherwise)."""
    if not given(args):
        return []
    words = ["--min-workers", str(args.min_workers), "--max-restarts", str(args.max_restarts)]
    if replica_size(args) > 1:
        words += ["--replica-size", str(replica_size(args))]
    if args.max_workers is not None:
        words += ["--max-workers", str(args.max_workers)]
    if args.elastic_timeout is not None:
        words += ["--elastic-timeout", repr(args.elastic_timeout)]
    return words


def replica_size(args):
    """Workers per data-parallel replica: the pipeline's stages times --tp (1 without a mesh)."""
    module = strategies.STRATEGIES[args.strategy]
    cuts_pp = "pp" in getattr(module, "CUTS", {}).get(args.strategy, ())
    return (module.stages(args) if cuts_pp else 1) * (args.tp or 1)


def batch_mode(args):
    return args.elastic_batch or "keep"


def commit_every(args):
    return args.commit_every or 10


def resume_problem(args, checkpoint):
    """Why ``checkpoint`` cannot continue this run, or None: an elastic run deals its data
    in another order (ElasticSampler) than a run without --min-workers (DistributedSampler),
    and keeps its position in the checkpoint; each resumes only its own kind exactly."""
    if given(args) and "elastic_sampler" not in checkpoint:
        return (f"{args.resume} was written by a run without --min-workers, whose data order an elastic run "
                "does not follow; resume it without --min-workers")
    if not given(args) and "elastic_sampler" in checkpoint:
        return f"{args.resume} was written by an elastic run (--min-workers); resume it with --min-workers"
    return None
