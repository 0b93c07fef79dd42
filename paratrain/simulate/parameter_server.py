"""A parameter-server step, predicted: every worker's pull and push through the servers' links.

paratrain's servers (paratrain/ps; Li et al., "Scaling Distributed Machine
Learning with the Parameter Server", OSDI 2014) each hold 1/S of the
parameters and run the optimizer on it. A worker pulls the weights before its
forward and pushes its gradient after its backward: n bytes each way, in S
messages. A server answers every worker: W n / S bytes each way, and applies
W n / S bytes of gradients. The servers default to one a host, beside its
workers (as Li et al. place them); their link is the network once the job
spans hosts.

- BSP: every worker waits for the round, so the step is compute plus the
  pull and the push, each as slow as the slower of a worker's link and a
  server's (a server's link carries W times a worker's share).
- ASP and SSP: nobody waits for the round, so a worker's step is the longer
  of its own loop (compute, pull, push) and its share of the servers' time
  (the servers are busy for every worker's push and pull). With no
  stragglers SSP's bound never binds and it predicts as ASP; what the model
  leaves out is the variance it exists for.
"""
from . import data_parallel
from .step import Step

CONSISTENCY = {"ps-bsp": "bsp", "ps-asp": "asp", "ps-ssp": "ssp"}


def step(workload, cluster, workers, consistency="bsp", servers=None, **_):
    hosts, _ = data_parallel.placement(cluster, workers)
    S = servers or hosts
    link = data_parallel.slowest_link(cluster, workers) if hosts > 1 else cluster.intra
    n = workload.gradient_bytes
    worker_way = S * link.alpha + n * link.beta            # one direction, one worker
    server_way = workers * (link.alpha + n / S * link.beta)  # one direction, one server
    update = workers * n / S * link.gamma
    compute = workload.step_compute_s
    if consistency == "bsp":
        exposed = 2 * max(worker_way, server_way) + update
    else:
        exposed = max(2 * worker_way, 2 * server_way + update - compute, 0.0)
    return Step(workers, compute, exposed, comm_s=2 * max(worker_way, server_way),
                how=f"{consistency}, {S} servers", batch_per_device=workload.batch_per_device)
