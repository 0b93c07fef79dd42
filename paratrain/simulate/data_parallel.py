"""A data-parallel step, predicted: compute, then what of the gradients' all-reduce backward did not hide.

pt.DataParallel (as PyTorch DDP, Li et al., VLDB 2020) cuts the gradients
into buckets of ``bucket_mb`` in the order backward produces them and
all-reduces each as soon as it is full, one at a time, while backward goes
on. So the step is the compute plus the communication left after backward
ends:

- forward takes (1 - backward_fraction) of the compute, then backward
  produces the gradient bytes at an even rate (a bucket is ready once
  backward has produced its last byte);
- bucket k's all-reduce starts when it is ready and the one before has
  finished, and takes the collective's cost for its bytes (collectives.py);
- exposed communication = the last all-reduce's end - the compute's end (0 if
  it ended first); step = compute + exposed.

The all-reduce is the one paratrain would run there: inside one host the
cheaper of ring and tree for the bucket's size, across hosts the cheaper of
a flat ring over the network and the hierarchical one (one buffer per host
over the network); ``algorithm`` forces one. Scaling efficiency is a
device's samples per second in the job over one device's alone: compute /
step. What the model leaves out: congestion between concurrent flows, the
slowdown of compute that shares memory bandwidth with communication, and
stragglers.
"""
import math

from .collectives import all_reduce, busy_ranks, hierarchical_all_reduce
from .step import Step, serial_channel

ALGORITHMS = ("ring", "tree", "hierarchical")   # what paratrain chooses from across hosts
FORCIBLE = ("ring", "tree", "direct", "hierarchical")
BUCKET_MB = 25.0   # pt.DataParallel's default


def placement(cluster, workers):
    """(hosts, devices per host) of ``workers`` devices, each host filled before the next."""
    if workers > cluster.devices:
        raise ValueError(f"{workers} workers, but the cluster {cluster.name!r} has {cluster.devices} devices "
                         f"({cluster.nodes} nodes x {cluster.devices_per_node})")
    per_host = min(workers, cluster.devices_per_node)
    return math.ceil(workers / per_host), per_host


def slowest_link(cluster, workers, algorithm=None):
    """The link a flat collective over ``workers`` devices is paced by: the network once they span
    hosts; inside one, its memory, slowed when more processes than cores share it (as many
    as ``algorithm`` keeps at work at once)."""
    hosts, per_host = placement(cluster, workers)
    if hosts > 1:
        return cluster.inter
    busy = busy_ranks(algorithm, per_host) if algorithm else per_host
    return cluster.host_link(busy)


def all_reduce_seconds(cluster, workers, n, algorithm):
    """One all-reduce of n bytes over ``workers`` devices of ``cluster`` by ``algorithm``."""
    hosts, per_host = placement(cluster, workers)
    if algorithm == "hierarchical":
        return hierarchical_all_reduce(hosts, per_host, n, cluster.intra, cluster.inter)
    return all_reduce(algorithm, workers, n).seconds(slowest_link(cluster, workers, algorithm))


def group_all_reduce_seconds(cluster, size, across_hosts, n, algorithm=None, workers=None):
    """An all-reduce over a group of ``size`` devices that is not the whole job (a stage's or
    a tensor group's replicas): over the network when ``across_hosts``, by ``algorithm`` or
    the cheapest of those paratrain runs there (inside a host, the cluster's host algorithms).
    Inside a host, its memory is slowed as a whole job's is when more processes than cores
    share it: the job's ``workers`` there, whose other groups run theirs, or compute, beside it."""
    if size == 1:
        return 0.0
    link = group_link(cluster, size, across_hosts, workers)
    algorithms = (algorithm,) if algorithm and algorithm != "hierarchical" else \
        ("ring", "tree") if across_hosts else cluster.host_algorithms
    return min(all_reduce(a, size, n).seconds(link) for a in algorithms)


def group_link(cluster, size, across_hosts, workers=None):
    """The link a group of ``size`` devices that is not the whole job meets: the network when
    ``across_hosts``; else the host's memory, slowed by the job's ``workers`` there."""
    if across_hosts:
        return cluster.inter
    return cluster.host_link(placement(cluster, max(size, workers or size))[1])


def choose(cluster, workers, n):
    """The algorithm paratrain would run for n bytes there: the cheapest by this model."""
    hosts, _ = placement(cluster, workers)
    candidates = ALGORITHMS if hosts > 1 else cluster.host_algorithms
    return min(candidates, key=lambda a: all_reduce_seconds(cluster, workers, n, a))


def buckets(total, bucket_bytes):
    full, rest = divmod(int(total), int(bucket_bytes))
    return [bucket_bytes] * full + ([rest] if rest else [])


def overlapped(workload, total, seconds_of, bucket_mb=BUCKET_MB, overlap=True):
    """(exposed, every transfer's time) of ``total`` gradient bytes sent in buckets of
    ``bucket_mb`` by ``seconds_of(bucket bytes)``: each bucket ready as backward produces its
    last byte (at an even rate; with ``overlap`` False, all at backward's end), sent one
    at a time."""
    compute = workload.step_compute_s
    produced, jobs = 0, []
    for size in buckets(total, bucket_mb * (1 << 20)):
        produced += size
        ready = workload.forward_s + workload.backward_s * produced / total if overlap else compute
        jobs.append((ready, seconds_of(size)))
    ends = serial_channel(jobs)
    return max(0.0, ends[-1] - compute) if ends else 0.0, sum(seconds for _, seconds in jobs)


def step(workload, cluster, workers, algorithm=None, bucket_mb=BUCKET_MB, **_):
    """The predicted data-parallel Step on ``workers`` devices (pt.DataParallel)."""
    placement(cluster, workers)
    if workers == 1:
        return Step.alone(workload)
    chosen = algorithm or choose(cluster, workers, min(workload.gradient_bytes, bucket_mb * (1 << 20)))
    exposed, comm = overlapped(workload, workload.gradient_bytes,
                               lambda size: all_reduce_seconds(cluster, workers, size, chosen), bucket_mb)
    return Step(workers, workload.step_compute_s, exposed, comm_s=comm, how=chosen,
                batch_per_device=workload.batch_per_device)


def naive_step(workload, cluster, workers, algorithm=None, **_):
    """pt.DataParallelNaive: every gradient tensor all-reduced after backward, one after
    another, none hidden; a tensor per layer (one message if the workload gives no layers)."""
    placement(cluster, workers)
    if workers == 1:
        return Step.alone(workload)
    tensors = workload.layers or 1
    size = workload.gradient_bytes / tensors
    chosen = algorithm or choose(cluster, workers, size)
    comm = tensors * all_reduce_seconds(cluster, workers, size, chosen)
    return Step(workers, workload.step_compute_s, comm, comm_s=comm, how=f"{chosen}, after backward",
                batch_per_device=workload.batch_per_device)
