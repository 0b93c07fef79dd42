"""A ZeRO step, predicted: the same bytes as an all-reduce, moved at other times (Rajbhandari et
al., "ZeRO", arXiv 1910.02054, sec. 7: stages 1 and 2 move 2 n per rank, as an all-reduce; stage 3
moves 3 n).

The collectives are pt.ZeRO's (parallel/zero/engine.py), ring reduce-scatters
and all-gathers over every worker, one at a time:

- stage 1: after backward, a reduce-scatter of every unit's gradients, the
  step, then an all-gather of the updated parameters: all of it exposed;
- stage 2: each unit's reduce-scatter as backward finishes it (overlapped, in
  backward's order), then the all-gather after the step;
- stage 3: a unit's parameters are gathered before its forward and again
  before its backward, each prefetched as the unit before starts, and its
  gradients reduce-scattered after its backward.

Units are as parallel/zero/layout.py lays them out: stages 1 and 2, buckets of
up to 25 MB (few, large collectives); stage 3, the workload's layers (one unit
if it gives none).
"""
import math

from . import data_parallel
from .collectives import all_gather, reduce_scatter
from .step import Step, serial_channel

MB = 1 << 20
STAGES = ("zero1", "zero2", "zero3")   # compare's names of the three stages


BUCKET_MB = 25.0   # pt.ZeRO's bucket_mb


def _unit_costs(workload, cluster, workers, stage):
    units = (workload.layers or 1) if stage == 3 else max(1, math.ceil(workload.gradient_bytes / (BUCKET_MB * MB)))
    n = workload.gradient_bytes / units
    link = data_parallel.slowest_link(cluster, workers)
    return units, all_gather(workers, n).seconds(link), reduce_scatter(workers, n).seconds(link)


def _pass(units, t, channel, ready, each, gather, scatter=None):
    """One direction over the units on one channel: a unit computes for ``each`` once its
    gather is in (``ready``), the next unit's gather is issued as it starts, and (backward,
    ``scatter``) its reduce-scatter as it ends. Returns (compute's end, channel's end)."""
    for k in range(units):
        start = max(t, ready)
        if k + 1 < units:
            channel = max(channel, start) + gather
            ready = channel
        t = start + each
        if scatter is not None:
            channel = max(channel, t) + scatter
    return t, channel


def stage3_exposed(units, forward, backward, gather, scatter):
    """(end of the step) - (compute) for stage 3's gathers and reduce-scatters on one channel:
    forward runs unit by unit once its gather is in, the next gather issued as a unit
    starts; backward likewise in reverse, each unit's reduce-scatter issued as it ends."""
    t, channel = _pass(units, 0.0, gather, gather, forward / units, gather)   # unit 0's gather: nothing hides it
    channel = max(channel, t) + gather    # the last unit's again, for its backward
    t, channel = _pass(units, t, channel, channel, backward / units, gather, scatter)
    return max(t, channel) - (forward + backward)


def step(workload, cluster, workers, stage=2, **_):
    data_parallel.placement(cluster, workers)
    if workers == 1:
        return Step.alone(workload, f"stage {stage}")
    units, gather, scatter = _unit_costs(workload, cluster, workers, stage)
    comm = units * (gather + scatter)
    if stage == 1:
        exposed = comm
    elif stage == 2:
        ends = serial_channel([(workload.forward_s + workload.backward_s * (k + 1) / units, scatter)
                               for k in range(units)])
        exposed = max(0.0, ends[-1] - workload.step_compute_s) + units * gather
    else:
        exposed = stage3_exposed(units, workload.forward_s, workload.backward_s, gather, scatter)
        comm += units * gather
    how = f"stage {stage}, {units} unit{'s' if units > 1 else ''}"
    return Step(workers, workload.step_compute_s, exposed, comm_s=comm, how=how,
                batch_per_device=workload.batch_per_device)
