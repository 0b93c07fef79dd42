"""The strategies ``paratrain simulate`` predicts, by ``paratrain compare``'s names.

Each entry is a function (workload, cluster, workers, **options) -> Step; the
options a strategy does not take it ignores (algorithm, bucket_mb, stages,
microbatches, tp, servers). One that cannot run raises step.Unavailable
with the reason, which ``predict`` returns in place of the Step.
"""
import dataclasses
from functools import partial

from . import compressed, data_parallel, parameter_server, pipeline, tensor, waits, zero
from .step import Unavailable

STRATEGIES = {
    "dp": data_parallel.step,
    "dp-naive": data_parallel.naive_step,
    **{name: partial(parameter_server.step, consistency=c) for name, c in parameter_server.CONSISTENCY.items()},
    **{name: partial(pipeline.step, schedule=s) for name, s in pipeline.SCHEDULES.items()},
    "tensor": tensor.step,
    "zero1": partial(zero.step, stage=1),
    "zero2": partial(zero.step, stage=2),
    "zero3": partial(zero.step, stage=3),
    "topk": compressed.topk_step,
    "powersgd": compressed.powersgd_step,
}


def predict(strategy, workload, cluster, workers, **options):
    """The Step, or the Unavailable saying why not (a worker count the cluster cannot hold
    raises ValueError: that is the user's mistake, not the strategy's); with the waiting
    for the slowest rank its synchronizations cost (waits.py), and, where a host's ranks
    outnumber its cores, what each synchronization of them adds (crowding.py)."""
    try:
        step = STRATEGIES[strategy](workload, cluster, workers, **options)
    except Unavailable as e:
        return e
    group = tensor.group_size(cluster, workers, options.get("tp")) if strategy == "tensor" else workers
    syncs = waits.synchronizations(strategy, workload)
    wait = waits.seconds(group, workload.step_jitter_s, syncs)
    if cluster.crowding:   # more of the group's ranks than cores on a host (crowding.py)
        _, ranks_here = data_parallel.placement(cluster, workers)
        wait += cluster.crowding.seconds(syncs, workload.step_compute_s, min(group, ranks_here), ranks_here,
                                         cluster.cores)
    # added to what a strategy finds itself (a pipeline's stages waiting for each other)
    return dataclasses.replace(step, wait_s=step.wait_s + wait) if wait else step
