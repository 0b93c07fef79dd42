"""Compressed data parallelism, predicted: fewer bytes on the wire, bought with encoding.

The buckets go as in data_parallel.py (overlapped with backward, one at a
time); what changes is what each bucket costs:

- top-k (Lin et al., arXiv 1712.01887; parallel/compression/topk.py): each
  rank's k = ratio x entries as int32 indices and fp32 values, all-gathered
  (sparse gradients do not sum on the way), then every rank adds up P k of
  them. 8 k bytes a rank instead of 4 k / ratio.
- PowerSGD (Vogels et al., arXiv 1905.13727; parallel/compression/powersgd.py):
  each m x n matrix goes as two all-reduces of rank-r factors, (m + n) r
  numbers. The workload's layers are taken as ``hidden`` x ``hidden``
  matrices, so a bucket of B bytes sends 2 r B / hidden.

Encoding reads a bucket a few times (top-k: the magnitudes, the selection,
the gather, the error feedback; PowerSGD: two products with the thin factor,
the error feedback, the decompression): ``ENCODE_PASSES`` passes at the
cluster's ``encode_gbps`` (a device's rate of streaming through gradient
memory; default its ``reduce_gbps``, else its intra-node rate), or the
workload's ``encode_s`` where it is measured (here.encode_seconds: the
compressor itself timed on the model's gradients, as plan and compare do)
or declared. It adds to the step: the encoder runs on the device that
computes. What this leaves out: top-k's warm-up (denser early steps) and
the small tensors sent whole.
"""
from . import data_parallel
from .collectives import all_gather
from .step import Step, Unavailable

ENCODE_PASSES = 4
TOPK_RATIO = 0.01      # paratrain train --compression topk's default
POWERSGD_RANK = 4      # and powersgd's
SPECS = {"topk": f"topk:{TOPK_RATIO:g}", "powersgd": f"powersgd:{POWERSGD_RANK}"}   # train's words for them


def encode_seconds(cluster, n):
    return ENCODE_PASSES * n * cluster.encode_beta


def factor_bytes(n, hidden, rank=POWERSGD_RANK):
    """What PowerSGD sends of n gradient bytes: rank-``rank`` factors of the layers' matrices,
    taken as ``hidden`` x ``hidden``."""
    if not hidden:
        raise Unavailable("powersgd factors the layers' matrices: give the workload's hidden")
    return n * rank / hidden


def encoding(workload, cluster, n):
    """A worker's encoding of its n gradient bytes a step: the workload's, measured or
    declared, else the formula."""
    return workload.encode_s if workload.encode_s is not None else encode_seconds(cluster, n)


def topk_seconds(cluster, workers, n, ratio, link=None):
    """One bucket of n gradient bytes by top-k: the all-gather of every rank's pairs, and the
    sum; over ``link`` (default: the one the whole job's collectives meet)."""
    k = max(1, round(ratio * n / 4))
    link = link or data_parallel.slowest_link(cluster, workers)
    return all_gather(workers, workers * k * 8).seconds(link) + workers * k * 4 * link.gamma


def seconds_of(compression, cluster, ranks, across_hosts, workers, hidden, algorithm=None):
    """A bucket's seconds of n bytes as a group of ``ranks`` replicas sends it under
    ``compression`` ("topk" or "powersgd", at paratrain train's defaults), the group not
    the whole job of ``workers`` (a tensor group's replicas): its link as
    data_parallel.group_link, across hosts or not."""
    if compression == "topk":
        link = data_parallel.group_link(cluster, ranks, across_hosts, workers)
        return lambda n: topk_seconds(cluster, ranks, n, TOPK_RATIO, link)
    if compression == "powersgd":
        share = factor_bytes(1, hidden)   # what a gradient byte sends (Unavailable without a width)
        return lambda n: 2 * data_parallel.group_all_reduce_seconds(cluster, ranks, across_hosts, n * share,
                                                                   algorithm, workers)
    raise ValueError(f"no cost model for compression {compression!r}; known: topk, powersgd")


def powersgd_seconds(cluster, workers, n, rank, hidden, algorithm):
    """One bucket of n gradient bytes by PowerSGD: two all-reduces of the factors (P, then Q)."""
    return 2 * data_parallel.all_reduce_seconds(cluster, workers, factor_bytes(n, hidden, rank), algorithm)


def _step(workload, cluster, workers, seconds_of, how, bucket_mb):
    data_parallel.placement(cluster, workers)
    if workers == 1:
        return Step.alone(workload)
    exposed, comm = data_parallel.overlapped(workload, workload.gradient_bytes, seconds_of, bucket_mb)
    return Step(workers, workload.step_compute_s, exposed, comm_s=comm, how=how,
                batch_per_device=workload.batch_per_device,
                extra_s=encoding(workload, cluster, workload.gradient_bytes))


def topk_step(workload, cluster, workers, ratio=TOPK_RATIO, bucket_mb=data_parallel.BUCKET_MB, **_):
    return _step(workload, cluster, workers, lambda n: topk_seconds(cluster, workers, n, ratio),
                 f"top-k {ratio:g}, all-gather", bucket_mb)


def powersgd_step(workload, cluster, workers, rank=POWERSGD_RANK, algorithm=None,
                  bucket_mb=data_parallel.BUCKET_MB, **_):
    chosen = algorithm or data_parallel.choose(cluster, workers, factor_bytes(workload.gradient_bytes, workload.hidden,
                                                                              rank))
    return _step(workload, cluster, workers,
                 lambda n: powersgd_seconds(cluster, workers, n, rank, workload.hidden, chosen),
                 f"PowerSGD rank {rank}, {chosen}", bucket_mb)
