"""The strategies of ``paratrain train``, by name: the table ``--strategy`` chooses from.

A strategy is one module here, and everything that differs between strategies
lives in it, so the trainer loop (trainer.py) and the front-end (job.py,
options.py) name none of them: adding one is a new file and a line in
STRATEGIES. Several names may share a module (allreduce and allreduce-naive
differ only in the wrapper); it then reads ``args.strategy`` itself.

What a strategy module provides:

    HELP                     what its names mean, one clause each, for --strategy's help
    SPARSE                   True when the recsys table's rows live off the model (on the
                             servers, pt.ps.Embedding), which builds the task differently
    add_options(parser)      its own flags, in an argument group titled after it
    check(args, chosen)      a message for what is wrong in its options, or None; called
                             for every module, chosen=False when another strategy runs
                             (so it can refuse its flags given to another)
    launcher_args(args)      extra words for ``paratrain run`` (servers, failure policy)
    SUMMARY                  {summary.json key: fn(step, args)}: its own summary fields
    make_step(task, args, settings)   this worker's step object, below

What it may declare about the options every strategy shares (layout.py,
compression.py, which ask this table rather than name a strategy); a module
that declares nothing cuts no layer and takes no --compression:

    CUTS                     {name: dims}: which of the layout's dims each of its names cuts
                             besides dp: "tp" (layers across --tp workers), "pp" (the model
                             between layers: --pp N > 1 is that strategy, and its module has
                             ``take_pp(args, n)``, which sets its stages to n or says why not,
                             and ``stages(args)``)
    COMPRESSES               {name: what --compression compresses there}

The step object, made once per worker (base.ReplicaStep gives the defaults of a
strategy whose workers each hold the whole model, base.GroupStep those of one
whose workers form a process group and move in lockstep):

    model                    what the loss calls (a DataParallel wrapper, or the bare model)
    stats                    CommStats: wait_seconds, comm_seconds, bytes (parallel/data.py)
    rank, world_size         this worker's place in the job
    local_loss               True when logged_loss is this worker's own (the summary then
                             averages the workers' last losses)
    finish_changes_weights   True when finish() brings weights the last evaluation must see
    coordination(settings, start)   (board, pool): how the workers meet and how many
                             batches this one takes (coordination.py)
    before_step(), after_backward(), logged_loss(loss), finish()   the loop's hooks
    state_dict(), load_state_dict(state)   what it checkpoints beside the model
    data_replicas, data_rank     how many shards the data is cut into, and this worker's
    forward_backward(task, batch)   the batch's loss, its gradients accumulated
    evaluate(task)               the evaluation (called on every worker; None where it is not done)
    checkpoint_path(path, writing)   the file this worker writes (None: none) or resumes from
    model_state(task), load_model_state(task, state)   the model's part in its checkpoint
"""
from . import allreduce, pipeline, ps, zero

STRATEGIES = {"allreduce": allreduce, "allreduce-naive": allreduce, "ps": ps, "pipeline": pipeline, "zero": zero}
DEFAULT = "allreduce"


def modules():
    """Each strategy module once, in the table's order (one module may serve several names)."""
    return list(dict.fromkeys(STRATEGIES.values()))


def cutting(dim):
    """The names whose module declares that they cut along ``dim`` ("pp" or "tp"), in the table's order."""
    return [name for name, module in STRATEGIES.items() if dim in getattr(module, "CUTS", {}).get(name, ())]


def compressing():
    """{name: what it compresses} for the strategies that take --compression, in the table's order."""
    return {name: module.COMPRESSES[name] for name, module in STRATEGIES.items()
            if name in getattr(module, "COMPRESSES", {})}


def check(args, shared=()):
    """A message for what is wrong in the strategies' options, or None. The chosen
    strategy answers first (what it cannot do at all, such as ps with --resume, is
    the clearest message), then ``shared``, the checks of the options every strategy
    shares (options.check passes them), then every other strategy about its own flags."""
    chosen = STRATEGIES[args.strategy]
    problem = chosen.check(args, chosen=True)
    for shared_check in shared:
        problem = problem or shared_check(args)
    for module in modules():
        if module is not chosen:
            problem = problem or module.check(args, chosen=False)
    return problem


def summary_fields(args, step):
    """The chosen strategy's summary fields, after every other strategy's set to None:
    summary.json has the same keys whichever strategy ran, so a reader comparing
    runs finds null where a field does not apply rather than no key."""
    fields = {key: None for module in modules() for key in module.SUMMARY}
    fields.update({key: value(step, args) for key, value in STRATEGIES[args.strategy].SUMMARY.items()})
    return fields
