"""``paratrain train --strategy ps``: the trainer's step over the parameter server.

Where DataParallel averages gradients among the workers and each worker runs
its own optimizer, here the optimizer runs on the servers: every step a
worker pulls the current weights (waiting as the consistency model says),
computes its gradient, pushes it and advances its clock. Nothing is
all-reduced among workers, so in ASP and SSP a fast worker is not held back
by the loss logging either: the logged loss is rank 0's own batches'.
"""
import time

import paratrain as pt

from ..parallel.data import CommStats


class ParameterServerStep:
    """The parts of a training step that talk to the servers, with the same
    ``stats`` the summary reads from DataParallel."""

    def __init__(self, model, optimizer, lr, consistency, staleness, predict=False):
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
