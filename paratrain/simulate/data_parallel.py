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
from dataclasses import dataclass

from .collectives import all_reduce, hierarchical_all_reduce

ALGORITHMS = ("ring", "tree", "hierarchical")
BUCKET_MB = 25.0   # pt.DataParallel's default


@dataclass(frozen=True)
class Step:
    workers: int
    compute_s: float
    exposed_s: float
    comm_s: float       # every all-reduce's time, hidden or not
    algorithm: str
    batch_per_device: int

    @property
    def step_s(self):
        return self.compute_s + self.exposed_s

    @property
    def samples_per_s(self):
        return self.workers * self.batch_per_device / self.step_s

    @property
    def efficiency(self):
        return self.compute_s / self.step_s


def placement(cluster, workers):
    """(hosts, devices per host) of ``workers`` devices, each host filled before the next."""
    if workers > cluster.devices:
        raise ValueError(f"{workers} workers, but the cluster {cluster.name!r} has {cluster.devices} devices "
                         f"({cluster.nodes} nodes x {cluster.devices_per_node})")
    per_host = min(workers, cluster.devices_per_node)
    return math.ceil(workers / per_host), per_host


def all_reduce_seconds(cluster, workers, n, algorithm):
    """One all-reduce of n bytes over ``workers`` devices of ``cluster`` by ``algorithm``."""
    hosts, per_host = placement(cluster, workers)
    if algorithm == "hierarchical":
        return hierarchical_all_reduce(hosts, per_host, n, cluster.intra, cluster.inter)
    link = cluster.inter if hosts > 1 else cluster.intra   # a flat ring or tree: the slowest hop paces it
    return all_reduce(algorithm, workers, n).seconds(link)


def choose(cluster, workers, n):
    """The algorithm paratrain would run for n bytes there: the cheapest by this model."""
    hosts, _ = placement(cluster, workers)
    candidates = ALGORITHMS if hosts > 1 else ("ring", "tree")
    return min(candidates, key=lambda a: all_reduce_seconds(cluster, workers, n, a))


def buckets(total, bucket_bytes):
    full, rest = divmod(int(total), int(bucket_bytes))
    return [bucket_bytes] * full + ([rest] if rest else [])


def step(workload, cluster, workers, algorithm=None, bucket_mb=BUCKET_MB):
    """The predicted data-parallel Step on ``workers`` devices."""
    compute = workload.step_compute_s
    placement(cluster, workers)
    if workers == 1:
        return Step(1, compute, 0.0, 0.0, "none", workload.batch_per_device)
    sizes = buckets(workload.gradient_bytes, bucket_mb * (1 << 20))
    chosen = algorithm or choose(cluster, workers, sizes[0])
    forward = compute * (1 - workload.backward_fraction)
    backward = compute * workload.backward_fraction
    produced, free_at, comm = 0, 0.0, 0.0
    for size in sizes:
        produced += size
        ready = forward + backward * produced / workload.gradient_bytes
        seconds = all_reduce_seconds(cluster, workers, size, chosen)
        free_at = max(ready, free_at) + seconds
        comm += seconds
    return Step(workers, compute, max(0.0, free_at - compute), comm, chosen, workload.batch_per_device)
