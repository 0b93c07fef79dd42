"""A pipeline's micro-batch from one stage to the next on this host, timed as the engine sends it.

Between two stages the engine sends a micro-batch's activations as a bundle
(parallel/pipeline/transport.py: a header saying each value's kind and shape,
then each tensor, one message each, through the shared-memory engine) and
receives their gradients back the same way. What that costs is not the
all-reduce's alpha and beta that ``--calibrate`` fits: each message is a call
on each side, a frame's header, a receive buffer allocated and a blocked
receiver woken, and a bundle is two of them. On this host gpt's micro-batch
of 4 samples (128 KiB) goes one way in 0.09-0.10 ms where the collective
fit gives 0.03, and a pipeline pays it twice a micro-batch on each stage.
Stages that compute 2-5 ms between messages see 0.19-0.37 ms a hop
(benchmarks/pipeline_hop.py: the receiver has slept and is woken); timed
here with both waiting, it is the lower bound of that.

The two processes are pinned to a core each: two stages that compute run on
two cores, and left to the scheduler, two processes that only pass messages
often share one and each hand-over waits for a switch (0.37-0.42 ms one way
in half the timings here, against 0.1).

``seconds(nbytes)`` is half the round trip of an activation bundle of
``nbytes`` one way and its gradient back, between two processes forked from
this one that form a two-rank shared-memory group, as two stages of
``paratrain train --strategy pipeline`` on this host do (the median of 200
round trips after 50).
"""
import multiprocessing
import os
import statistics
import time

from . import forked

WARMUP, TIMED = 50, 200


def seconds(nbytes, timeout=30.0):
    """One way of a pipeline's bundle of ``nbytes`` of activations and its gradients back,
    here (half the median round trip), in seconds."""
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fork = multiprocessing.get_context("fork")
    answer, told = fork.Pipe(duplex=False)
    stages = [fork.Process(target=_stage, args=(rank, store.port, int(nbytes), timeout, told), daemon=True)
              for rank in (0, 1)]
    for p in stages:
        p.start()
    try:
        if not answer.poll(timeout):
            raise RuntimeError(f"timing a pipeline's send: the two stages did not answer within {timeout:g} s")
        got = answer.recv()
        if isinstance(got, str):
            raise RuntimeError(f"timing a pipeline's send failed: {got}")
        return got
    finally:
        forked.end(stages, 10)


def exchange_times(group, values, n, between=lambda: None):
    """n exchanges between the two ranks of ``group`` as two pipeline stages make them:
    rank 0 sends the activations ``values`` and receives their gradients, rank 1 receives
    and sends them back, each calling ``between()`` (its compute) in the middle; this
    rank's seconds for each."""
    from ..parallel.pipeline import transport
    times = []
    for _ in range(n):
        works = []
        t0 = time.perf_counter()
        if group.rank == 0:
            transport.send_activations(group, values, 1, 1, works)
            between()
            transport.recv_gradients(group, 1, 1, values)
        else:
            got = transport.recv_activations(group, 0, 1)
            between()
            transport.send_gradients(group, got, 0, 1, works)
        for work, _ in works:
            work.wait()
        times.append(time.perf_counter() - t0)
    return times


def _stage(rank, port, nbytes, timeout, told):
    """One of the two stages: rank 0 sends activations and receives their gradients, rank 1
    the other way round; rank 0 tells the parent the median round trip's half."""
    try:
        import torch

        from ..comm.rendezvous import connect_client
        from ..comm.shm.group import ShmGroup
        from ..launch.heap import keep_freed_memory
        keep_freed_memory()   # as paratrain run's bootstrap does for a worker
        torch.set_num_threads(1)
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > 1:   # each on a core of its own, as two stages that compute end up
            os.sched_setaffinity(0, {cpus[rank]})
        group = ShmGroup(connect_client("127.0.0.1", port, timeout), "stage-send", rank, [0, 1], timeout)
        trips = exchange_times(group, (torch.randn(max(1, nbytes // 4)),), WARMUP + TIMED)
        group.barrier()
        if rank == 0:
            told.send(statistics.median(trips[WARMUP:]) / 2)
    except Exception as e:   # the parent raises it
        told.send(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        os._exit(0)
