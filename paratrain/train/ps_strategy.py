"""``paratrain train --strategy ps``: the trainer's step over the parameter server.

Where DataParallel averages gradients among the workers and each worker runs
its own optimizer, here the optimizer runs on the servers: every step a
worker pulls the current weights (waiting as the consistency model says),
computes its gradient, pushes it and advances its clock. Nothing is
all-reduced among workers, so in ASP and SSP a fast worker is not held back
by the loss logging either: the logged loss is rank 0's own batches'.

Workers run under SCHED_BATCH (Linux; any user may choose it, and
PARATRAIN_PS_SCHED_BATCH=0 keeps the default policy). A server answers the
workers of a BSP round one after another, and without it the first worker
it wakes takes the server's core on the spot (the scheduler favours a task
that slept), so the next answer waits: measured on the 2-core VM with 2
workers, 115-145 us per answer on the server, 17-23 us with SCHED_BATCH,
whose tasks do not preempt on wake-up. Compute-bound workers are what that
policy is for.
"""
import os

import paratrain as pt

from ..parallel.data import CommStats


class ParameterServerStep:
    """The parts of a training step that talk to the servers, with the same
    ``stats`` the summary reads from DataParallel."""

    def __init__(self, model, optimizer, lr, consistency, staleness, predict=False):
        if os.environ.get("PARATRAIN_PS_SCHED_BATCH", "1") != "0" and hasattr(os, "SCHED_BATCH"):
            try:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            except OSError:
                pass   # (not allowed here: the default policy, slower by a wake-up per answer)
        self.model = model
        self.stats = CommStats()
        self.ps = pt.ps.connect()
        hyper = {"lr": lr, **({"momentum": 0.9} if optimizer == "sgd" else {})}
        self.ps.register(model, optimizer=optimizer, consistency=consistency, staleness=staleness,
                         predict=predict, **hyper)
        self.predict = predict
        self.pulled = False

    def _timed(self, fn):
        """Run a pull or push; the client's own counters give the time spent waiting
        for servers and the bytes moved, including the embedding rows each forward
        pulls (pt.ps.Embedding), which happen outside these calls."""
        fn()
        self.stats.wait_seconds = self.stats.comm_seconds = self.ps.wait_seconds
        self.stats.bytes = self.ps.bytes_sent + self.ps.bytes_received

    def before_step(self):
        if not self.pulled:   # the first step; afterwards step() has brought the weights
            self._timed(self.ps.pull)
        self.pulled = False
        self.model.zero_grad(set_to_none=False)

    def after_backward(self):
        """Push, clock, and pull the next step's weights, as one request per server on
        this host (Client.step): the reply comes when the consistency model allows."""
        self._timed(self.ps.step)
        self.pulled = True
        self.stats.allreduces += 1

    def logged_loss(self, loss):
        return loss.item()

    def finish(self):
        """The final weights into the model (for the last evaluation and the checkpoint),
        then leave: under SSP a worker that has stopped clocking must not hold back
        those still taking batches from the shared pool (coordination.py)."""
        if not self.pulled or self.predict:   # (the last step() brought them, unless predicted ones)
            self.ps.pull(exact=True)
        self.ps.leave()   # still connected: the final evaluation may read embedding rows

    def staleness_histogram(self):
        """{lag: reads} summed over the servers: how many clocks each read was ahead of
        the slowest worker (each server counts the reads of its own pieces; server.py).
        Asked on a fresh connection, since finish() has closed ours; call it once every
        worker has finished, so the counts are complete."""
        client = pt.ps.connect()
        try:
            total = {}
            for server in range(len(client.addrs)):
                for lag, count in client.stats(server).get("histogram", {}).items():
                    total[int(lag)] = total.get(int(lag), 0) + int(count)
            return dict(sorted(total.items()))
        finally:
            client.close()
