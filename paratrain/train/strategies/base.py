"""What most strategies' step objects do alike: one replica of the model per worker.

A strategy whose workers each hold the whole model and read their own shard
of the data (allreduce, ps) inherits all of this; one that cuts the model
across workers (pipeline) overrides what differs: which workers read the same
data, how a batch becomes a loss and gradients, what each worker checkpoints,
and who evaluates. GroupStep adds what the strategies whose workers form one
process group share (allreduce, pipeline, zero): how they meet, and the loss.
"""
import time

import torch

from ...trace import recorder as trace
from ..coordination import GroupBoard, Lockstep


class ReplicaStep:
    """Defaults for a step object (see strategies/__init__.py for the whole interface).
    Subclasses set ``model``, ``rank`` and ``world_size``."""

    @property
    def data_replicas(self):
        """How many different shards the data is cut into (the DistributedSampler's num_replicas)."""
        return self.world_size

    @property
    def data_rank(self):
        """Which shard this worker reads."""
        return self.rank

    loss_weight = 1.0   # elastic, a share of a step's global batch: its weight in the workers' mean

    def forward_backward(self, task, batch):
        """The batch's loss (times ``loss_weight``), with its gradients accumulated into the model."""
        if getattr(self.model, "traces_its_passes", False):   # pt.DataParallel
            loss = self._weighted(task.loss(self.model, batch))
            loss.backward()
            return loss
        with trace.span("forward", "compute"):
            loss = self._weighted(task.loss(self.model, batch))
        with trace.span("backward", "compute"):
            loss.backward()
        return loss

    def _weighted(self, loss):
        return loss if self.loss_weight == 1.0 else loss * self.loss_weight

    def evaluate(self, task):
        """The task's evaluation, on rank 0 (the others return None). Every worker calls it."""
        return task.evaluate(task.model) if self.rank == 0 else None

    def checkpoint_path(self, path, writing):
        """The file this worker writes (None: it writes none) or reads on resume."""
        return path if not writing or self.rank == 0 else None

    def model_state(self, task):
        return task.model.state_dict()

    def load_model_state(self, task, state):
        task.model.load_state_dict(state)


class GroupStep(ReplicaStep):
    """Workers in one process group (``self.group``), in lockstep: they meet and report
    through the group (coordination.GroupBoard), each takes exactly its steps, and the
    logged loss is the mean over every worker's batch."""

    local_loss = False             # logged_loss is already the mean over the workers
    finish_changes_weights = False

    def coordination(self, settings, start):
        return GroupBoard(self.group), Lockstep(settings.steps, start)

    def before_step(self):
        pass

    def logged_loss(self, loss):
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        t0 = time.perf_counter()
        self.group.all_reduce(mean, op="avg")   # the loss over every worker's batch, not rank 0's alone
        # Counted as waiting: when a worker is slower after backward (a --straggler sleeps
        # there, slowdown.py), this is where the others wait for it.
        self.stats.blocked(time.perf_counter() - t0)
        return float(mean[0])

    def finish(self):
        pass


class LastStepTraffic:
    """With --tp: what the tensor-parallel layers' collectives moved in the last training
    step (pt.tensor.traffic, by kind), for the summary, and the seconds the layers were
    blocked in them. ``start()`` before a step, ``stop()`` after its backward; without
    tensor parallelism it records nothing."""

    def __init__(self, tp):
        self.on, self.bytes, self._seconds = tp > 1, None, 0.0

    def start(self):
        if self.on:
            from ...parallel.tensor import traffic
            traffic.reset()
            self._seconds = traffic.seconds

    def count_blocked(self, stats):
        """Add the seconds the step's collectives blocked it so far to ``stats`` as waiting, as
        a data-parallel wait is: the trainer's compute leaves them out (the trace's
        breakdown does too)."""
        if self.on:
            from ...parallel.tensor import traffic
            stats.blocked(traffic.seconds - self._seconds)
            self._seconds = traffic.seconds

    def stop(self):
        if self.on:
            from ...parallel.tensor import traffic
            self.bytes = dict(traffic.bytes)

    def per_layer(self, count_layers):
        """The step's bytes over the layers ``count_layers()`` says the worker holds."""
        layers = count_layers() if self.bytes else 0
        return round(sum(self.bytes.values()) / layers) if layers else None
