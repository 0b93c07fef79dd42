"""A pipeline-parallel step, predicted by running the engine's own schedule with each action's cost.

``stages`` devices hold a replica, cut between its layers; ``workers /
stages`` replicas average their stages' gradients after the pipeline drains.
A replica's batch is its devices' batches together, cut into
``microbatches``; a micro-batch holds p/m of a device's samples and a stage
1/p of the layers, so a stage runs forward on a micro-batch in forward / m
and backward in backward / m of one device's step. Between stages go a
micro-batch's activations, and their gradients back: (p/m) x the workload's
activation bytes each, over the link the stages span.

With ``tp`` > 1 (3D: pipeline stages each cut across a tensor group, as
``paratrain train --pp P --tp T`` runs them) a replica is p x t devices and
its micro-batch t times larger; each stage's layers add tensor.py's
all-reduces of that micro-batch's activations, two a layer in F and two in
B, on the critical path, and the stages' gradients are 1/(p t) of the model's.

The step is the makespan of ``schedules.simulate`` (the order
parallel/pipeline/schedules.py gives every rank, run against each other)
with F = f + send, B = b + send. On one host a workload measured here
carries ``stage_send_s``, the engine's own bundle timed between two stages
(stage_send.py: two messages, each a call on each side and a woken
receiver; gpt's 0.09-0.10 ms where the all-reduce's alpha and beta give
0.03); elsewhere the link's alpha and beta. The engine splits a backward into B (input
gradients) and W (weights'): under ZB-H1 on every stage, W placed by the
schedule; under 1F1B on every stage but the first, W at once. A split one
takes the workload's ``split_cost`` times b, W its ``weight_fraction`` of that
(1 and 1/2 by default). A built-in model's pipeline measured here carries
instead ``stage_actions``, every rank's F, B and W as the engine ran them
(stage_actions.py), each stage at its own cost. The makespan is the step;
the bubble is what the schedule leaves idle (GPipe's and 1F1B's (p-1)/(m+p-1)
of the step when sends are free; ZB-H1 about a third of that), not a
formula laid over it.

Stages whose compute jitters from step to step (the workload's
``step_jitter_s``) also wait for each other: every micro-batch handed on is
a meeting of two ranks, and the later one sets when the next action starts.
How much of that the schedule's own slack absorbs depends on the schedule
(ZB-H1 fills its bubbles with W, so it has less to absorb with), so the wait
is found by running it again with each action's time drawn around its cost
(jittered_wait), not by a formula per meeting as waits.py charges collectives.
"""
import math

import numpy as np

from ..parallel.pipeline import schedules
from . import data_parallel, tensor
from .step import Step, Unavailable

SCHEDULES = {"pipeline": "1f1b", "pipeline-zb": "zb-h1"}
MICROBATCHES = 4   # paratrain train --strategy pipeline's default
DRAWS = 200        # runs of the schedule with drawn action times (jittered_wait)


def jittered_wait(schedule, p, m, cost, spread, draws=DRAWS, seed=0):
    """How much longer, on average, the schedule takes when each rank's compute varies by
    ``spread`` of itself (a standard deviation over the mean) from step to step: the
    stochastic makespan of the schedule's graph (as PERT's, Malcolm et al. 1959) less
    the fixed one. A rank's variance is spread over its actions in proportion to their
    length (an action of d seconds on a rank busy B: sigma^2 = spread^2 B d, so its
    step varies by spread B), each drawn on its own. The mean of ``draws`` runs, drawn
    from a fixed seed so that a prediction is the same each time it is asked."""
    if not spread:
        return 0.0
    makespan, busy, _ = schedules.simulate(schedule, p, m, cost=cost)
    rng = np.random.default_rng(seed)

    def drawn(rank, kind, seconds):   # every draw of this action at once
        return np.maximum(0.0, seconds + rng.normal(0.0, spread * math.sqrt(busy[rank] * seconds), draws))
    ends = schedules.simulate(schedule, p, m, cost=cost, duration=drawn)[0]
    return max(0.0, float(np.mean(ends)) - makespan)


def default_stages(cluster, workers):
    """As many stages as a host holds devices (activations cross fast links), at most ``workers``."""
    return min(workers, cluster.devices_per_node)


def step(workload, cluster, workers, schedule="1f1b", stages=None, microbatches=MICROBATCHES, algorithm=None,
         tp=1, **_):
    hosts, _per_host = data_parallel.placement(cluster, workers)
    p, t = stages or default_stages(cluster, workers), tp or 1
    if workers % (p * t):
        raise Unavailable(f"{workers} workers are not a multiple of {p} stages" + (f" x --tp {t}" if t > 1 else ""))
    if workload.need_layers("a pipeline") < p:
        raise Unavailable(f"{p} stages, but the workload has {workload.layers} layers")
    m = microbatches
    if p == 1:
        return tensor.step(workload, cluster, workers, tp=t, algorithm=algorithm)
    link = data_parallel.slowest_link(cluster, p * t)   # a stage's next is t devices on
    activations = workload.layer_activation_bytes("a pipeline") * p * t / m
    send = link.alpha + activations * link.beta
    if workload.stage_send_s is not None and hosts == 1:   # the engine's own, timed here (plan.py)
        send = workload.stage_send_s
    cut = 0.0   # a micro-batch's tensor all-reduces in F, and as many in B
    if t > 1:
        cut = tensor.ALL_REDUCES_PER_LAYER // 2 * workload.layers / p * data_parallel.group_all_reduce_seconds(
            cluster, t, t > cluster.devices_per_node, activations, workers=workers)
    f, b = workload.forward_s / m, workload.backward_s / m
    split = b * workload.split_cost            # B and W one after the other
    w = split * workload.weight_fraction
    paid = cut + send                          # what F and B each add to their compute
    if workload.stage_actions:   # each rank's own, as the engine ran them here (W inside B unless split)
        if len(workload.stage_actions) != p:
            raise ValueError(f"the workload's stage_actions are {len(workload.stage_actions)} ranks', not {p}")
        cost = [{"F": F + paid, "B": B + paid, **({"W": W} if schedule in schedules.SPLIT_BACKWARD else {})}
                for F, B, W in workload.stage_actions]
    elif schedule in schedules.SPLIT_BACKWARD:
        cost = [{"F": f + paid, "B": split - w + paid, "W": w}] * p
    else:   # the engine splits every stage's backward but the first's, W at once
        cost = [{"F": f + paid, "B": b + paid}] + [{"F": f + paid, "B": split + paid}] * (p - 1)
    makespan, busy, _trace = schedules.simulate(schedule, p, m, cost=cost)
    sends, inside = 2 * m * send, 2 * m * cut
    replicas = workers // (p * t)
    grads = data_parallel.group_all_reduce_seconds(cluster, replicas, hosts > 1, workload.gradient_bytes / (p * t),
                                                   algorithm, workers)
    compute = max(busy) - sends - inside
    spread = workload.step_jitter_s / workload.step_compute_s if workload.step_compute_s else 0.0
    return Step(workers, compute, sends + inside + grads, bubble_s=max(0.0, makespan - max(busy)),
                comm_s=sends + inside + grads, wait_s=jittered_wait(schedule, p, m, cost, spread),
                how=f"{schedule}, {p} stages" + (f" of tp {t}" if t > 1 else "") + f" x {replicas}, {m} micro-batches",
                batch_per_device=workload.batch_per_device)
