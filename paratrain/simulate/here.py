"""What ``paratrain simulate`` knows of this machine and of the built-in models, measured here.

- ``workload_of("gpt")``: a WORKLOAD for a built-in model (``model = "gpt"`` in
  a WORKLOAD.toml, or ``--workload gpt``): its parameters and shape from the
  task itself, and ``step_compute_ms`` timed here, forward and backward of one
  worker's default batch in one process on one thread (the median of a few
  steps after a warm-up), as ``paratrain train``'s workers compute.
- ``cluster_here()``: ``--cluster here``, this host as one node of as many
  devices as it has cores, its link the one ``paratrain simulate --calibrate``
  fitted (calibration.json); the direct all-reduce's constants, since that is
  what paratrain runs inside a host.
"""
import json
import os
import statistics
import time

from .collectives import Link
from .files import Cluster, Workload

WARMUP, TIMED = 2, 5


def _shape(task):
    """(layers, hidden, seq_len) of a built-in task's model, where it has them."""
    c = task.config
    if "n_layer" in c:
        return c["n_layer"], c["n_embd"], c["block_size"]
    if "layers" in c and "width" in c:
        return c["layers"], c["width"], c.get("positions")
    if "sizes" in c:
        return len(c["sizes"]) - 1, max(c["sizes"][1:-1] or c["sizes"]), 1
    return None, None, None


def time_step(task, batch_size, warmup=WARMUP, timed=TIMED):
    """Median seconds of forward + backward of ``batch_size`` samples on this process."""
    import torch
    loader = torch.utils.data.DataLoader(task.train_set, batch_size=batch_size, shuffle=False, drop_last=True)
    batches = iter(loader)
    times = []
    for i in range(warmup + timed):
        batch = next(batches)
        t0 = time.perf_counter()
        task.loss(task.model, batch).backward()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        task.model.zero_grad(set_to_none=True)
    return statistics.median(times)


def workload_of(model, batch_size=None, seed=0):
    """The Workload of built-in model ``model``, its step timed here on one thread."""
    import torch
    from ..train.tasks import TASKS, build_task
    if model not in TASKS:
        raise ValueError(f"model = {model!r}: not a built-in model; choose from {', '.join(TASKS)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as paratrain train's workers (--threads 1)
    try:
        task = build_task(model, seed=seed)
        batch = batch_size or task.defaults["batch_size"]
        seconds = time_step(task, batch)
    finally:
        torch.set_num_threads(threads)
    layers, hidden, seq_len = _shape(task)
    params = sum(p.numel() for p in task.model.parameters())
    return Workload(f"{model} (measured here)", params, 4, batch, seconds, layers=layers, hidden=hidden,
                    seq_len=seq_len)


def cluster_here(calibration):
    """This host as a cluster, its link from the stored calibration (``calibration`` its path)."""
    try:
        with open(calibration) as f:
            links = json.load(f)["links"]
        link = Link(**links.get("shm_direct") or next(iter(links.values())))
    except FileNotFoundError:
        raise ValueError(f"--cluster here needs this machine's links: run `paratrain simulate --calibrate` "
                         f"first (no {calibration})") from None
    except (ValueError, KeyError, TypeError, StopIteration):
        raise ValueError(f"{calibration} is not a calibration paratrain wrote: run `paratrain simulate "
                         "--calibrate` again") from None
    return Cluster(f"this host ({os.cpu_count()} cores, calibrated)", 1, os.cpu_count() or 1, link, link,
                   host_algorithms=("direct",))
