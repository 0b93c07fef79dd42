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
the weights back out, piece by piece, and rings a doorbell (the link's
alpha); an ASP or SSP server copies each worker's weights into that worker's
pull region before it answers, where BSP's workers read the round's weights
in place. The workload's ``shared_copy_s`` is one such copy of every
parameter, as timed here (here.py: gpt's 53 pieces, 0.5 ms a way, where
the calibrated memcpy rate gives 0.1-0.2); without it the link's beta stands
for it.

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
    if hosts == 1 and workload.shared_copy_s is not None:   # through the servers' shared segments
        worker_way = S * link.alpha + workload.shared_copy_s   # one direction, one worker
        server_copy = workload.shared_copy_s / S if consistency != "bsp" else 0.0   # a worker's weights out
        server_in, server_out = workers * link.alpha, workers * (link.alpha + server_copy)   # one server
    else:
        worker_way = S * link.alpha + n * link.beta
        server_copy, server_in = 0.0, workers * (link.alpha + n / S * link.beta)
        server_out = server_in
    comm = max(worker_way, server_in) + max(worker_way, server_out)
    if consistency == "bsp":
        exposed = comm + summed
    else:   # each push applied as it comes: the optimizer once a push (without it, gamma for the update)
        server_busy = server_in + server_out + (workers * optimizer if workload.server_update_s else summed)
        exposed = max(2 * worker_way + server_copy, server_busy - compute - optimizer, 0.0)
    return Step(workers, compute, exposed, comm_s=comm, extra_s=optimizer,
                how=f"{consistency}, {S} servers", batch_per_device=workload.batch_per_device)
