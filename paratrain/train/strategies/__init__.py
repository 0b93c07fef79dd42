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

The step object, made once per worker (base.ReplicaStep gives the defaults of a
strategy whose workers each hold the whole model):

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


def check(args):
    """A message for what is wrong in the strategies' options, or None. The chosen
    strategy answers first (what it cannot do at all, such as ps with --resume, is
    the clearest message), then every other one about its own flags."""
    chosen = STRATEGIES[args.strategy]
    for module in [chosen] + [m for m in modules() if m is not chosen]:
        problem = module.check(args, chosen=module is chosen)
        if problem:
            return problem
    return None


def summary_fields(args, step):
    """The chosen strategy's summary fields, after every other strategy's set to None:
    summary.json has the same keys whichever strategy ran, so a reader comparing
    runs finds null where a field does not apply rather than no key."""
    fields = {key: None for module in modules() for key in module.SUMMARY}
    fields.update({key: value(step, args) for key, value in STRATEGIES[args.strategy].SUMMARY.items()})
    return fields
