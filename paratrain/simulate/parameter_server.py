"""A parameter-server step, predicted: every worker's pull and push through the servers' links.

paratrain's servers (paratrain/ps; Li et al., "Scaling Distributed Machine
Learning with the Parameter Server", OSDI 2014) each hold 1/S of the
parameters and run the optimizer on it. A worker pulls the weights before its
forward and pushes its gradient after its backward: n bytes each way, in S
messages. A server answers every worker: W n / S bytes each way, and applies
W n / S bytes of gradients. The servers default to one a host, beside its
workers (as Li et al. place them); their link is the network once the job
spans hosts.

The servers, not the workers, run the optimizer: a worker's compute is its
forward and backward alone, and the update is the servers' (the workload's
``server_update_s``, the optimizer over every parameter as a server runs it:
each server steps its 1/S, all at once). Without it the gradients' summing
(gamma) stands for the update.

Servers on their workers' host (one host) meet them through shared memory
(paratrain/ps/shared.py): a worker copies its gradients into the segment and
the weights back out, piece by piece, and rings a doorbell; an ASP or SSP
server copies each worker's weights into that worker's pull region before
it answers, where BSP's workers read the round's weights in place. The
workload's ``ps_step_s`` is all of that as timed here for one worker and
its server (here.ps_step_seconds: gpt's 3.9-6.3 ms, of which the update is
1.3 and a memcpy's rate would give the copies 0.3), the optimizer included;
a step of W workers adds the round's other W-1 sums under BSP. Without it,
a worker's way is the link's alpha and beta.

- BSP: every worker waits for the round, so the step is compute plus the
  pull and the push, each as slow as the slower of a worker's link and a
  server's (a server's link carries W times a worker's share), plus the
  round's sum, and one optimizer step (the step's ``extra``).
- ASP and SSP: nobody waits for the round, but a worker's pull answers after
  its own push is applied: its loop is compute, the update of its push, pull
  and push. Its step is the longer of that loop and its share of the
  servers' time (the servers are busy for every worker's push and pull, and
  step their optimizer once per push). With no stragglers SSP's bound never
  binds and it predicts as ASP; what the model leaves out is the variance it
  exists for.
"""
from . import data_parallel
from .step import Step

CONSISTENCY = {"ps-bsp": "bsp", "ps-asp": "asp", "ps-ssp": "ssp"}


def step(workload, cluster, workers, consistency="bsp", servers=None, **_):
    hosts, _ = data_parallel.placement(cluster, workers)
    S = servers or hosts
    link = data_parallel.slowest_link(cluster, workers) if hosts > 1 else cluster.intra
    n = workload.gradient_bytes
    summed = workers * n / S * link.gamma       # a BSP round's sum on one server
    optimizer = (workload.server_update_s or 0.0) / S   # one optimizer step on a server's share
    compute = workload.step_compute_s
    worker_way = S * link.alpha + n * link.beta            # one direction, one worker
    server_way = workers * (link.alpha + n / S * link.beta)  # one direction, one server
    timed = hosts == 1 and workload.ps_step_s is not None
    if timed:   # one worker's step beside its server, timed here, less the update (the step's extra)
        own = comm = max(0.0, workload.ps_step_s - (workload.server_update_s or 0.0))
    else:
        own, comm = 2 * worker_way, 2 * max(worker_way, server_way)
    if consistency == "bsp":
        exposed = own + summed * (workers - 1) / workers if timed else comm + summed
    else:   # each push applied as it comes: the optimizer once a push (without it, gamma for the update)
        server_busy = 2 * server_way + (workers * optimizer if workload.server_update_s else summed)
        exposed = max(own, server_busy - compute - optimizer, 0.0)
    return Step(workers, compute, exposed, comm_s=comm, extra_s=optimizer,
                how=f"{consistency}, {S} servers", batch_per_device=workload.batch_per_device)
