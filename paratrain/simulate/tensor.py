"""A tensor-parallel step, predicted: Megatron's all-reduces of activations, none of them hidden.

Megatron-LM (Shoeybi et al., arXiv 1909.08053, sec. 3) cuts each block's two
matrix pairs across ``tp`` devices, so each block costs two all-reduces of
its output in forward and two of its input's gradient in backward, on the
critical path: the next layer needs them. The group's batch is its devices'
batches together (tp x the activation bytes), and each device computes 1/tp
of it, so its compute is one device's step. ``workers / tp`` replicas then
average their shards' gradients (n / tp bytes each) overlapped with
backward, as data_parallel.py does; with ``compression`` (top-k or PowerSGD,
as ``paratrain train --tp T --compression``), compressed as compressed.py
prices it, each worker encoding its shard. What this leaves out: a cut
matrix multiply runs less efficiently than a whole one (smaller matrices).
"""
from . import compressed, data_parallel
from .step import Step, Unavailable

ALL_REDUCES_PER_LAYER = 4   # forward: after attention and after the MLP; backward: the same two


def default_tp(cluster, workers):
    """As many devices as a host holds (Megatron keeps tensor groups inside a host), at most ``workers``."""
    return min(workers, cluster.devices_per_node)


def group_size(cluster, workers, tp=None):
    """The tensor group: ``tp`` as given, else default_tp."""
    return tp or default_tp(cluster, workers)


def step(workload, cluster, workers, tp=None, algorithm=None, bucket_mb=data_parallel.BUCKET_MB,
         compression=None, **_):
    hosts, _ = data_parallel.placement(cluster, workers)
    t = group_size(cluster, workers, tp)
    if workers % t:
        raise Unavailable(f"{workers} workers are not a multiple of --tp {t}")
    if t == 1:   # no tensor group: data parallelism, compressed or not
        whole = {None: data_parallel.step, "topk": compressed.topk_step, "powersgd": compressed.powersgd_step}
        return whole[compression](workload, cluster, workers, algorithm=algorithm, bucket_mb=bucket_mb)
    layers = workload.need_layers("tensor parallelism")
    activations = workload.layer_activation_bytes("tensor parallelism") * t
    per_layer = data_parallel.group_all_reduce_seconds(cluster, t, t > cluster.devices_per_node, activations,
                                                       workers=workers)
    inside = ALL_REDUCES_PER_LAYER * layers * per_layer
    replicas = workers // t
    across, encode, how = (0.0, 0.0), 0.0, f"tp {t} x dp {replicas}"
    if replicas > 1:
        if compression:
            bucket_seconds = compressed.seconds_of(compression, cluster, replicas, hosts > 1, workers,
                                                   workload.hidden, algorithm)
            encode = compressed.encoding(workload, cluster, workload.gradient_bytes / t)
            how += f", {compression}"
        else:
            def bucket_seconds(n):
                return data_parallel.group_all_reduce_seconds(cluster, replicas, hosts > 1, n, algorithm, workers)
        across = data_parallel.overlapped(workload, workload.gradient_bytes / t, bucket_seconds, bucket_mb)
    return Step(workers, workload.step_compute_s, inside + across[0], comm_s=inside + across[1], how=how,
                batch_per_device=workload.batch_per_device, extra_s=encode)
