"""Uneven inputs: a rank that runs out of batches must not hang the others.

Data parallelism is a lock-step protocol: every synchronised backward is a set
of all-reduces that every rank must join. When one rank's data ends first (an
uneven shard, a data set that does not divide), the others would wait for it
forever. This is the protocol of PyTorch's ``Join`` / DDP ``join()`` (the
"shadow" collectives, torch.distributed.algorithms.join):

- inside ``with model.join():``, every training forward all-reduces a small
  flag tensor [1, will-sync] (sum): how many ranks are still training, and
  whether their next backward averages gradients;
- a rank that has left its loop keeps answering: it all-reduces [0, 0]; if
  somebody is still training and will sync, it makes the same gradient
  all-reduces as a backward would, contributing zeros;
- when the flag sum says no rank is training any more, everyone leaves, and the
  model of a rank that trained longest (ties: the lowest rank) is broadcast to
  all, so the replicas are equal again.

As with DDP's default, gradients are still divided by the full world size while
some ranks contribute zeros. Not covered, as in DDP: a training-mode forward
with gradients enabled must be followed by its backward (the joined ranks
shadow one backward per such forward), buffers are not broadcast at each
forward while joining (they are at the end), and joined ranks' optimizer
states are stale afterwards.
"""
import torch


class Join:
    def __init__(self, model, enable=True):
        self.model = model
        self.enable = enable and model.group.world_size > 1
        self.steps = 0

    def __enter__(self):
        if self.enable:
            self.model._joining = self
        return self

    def on_forward(self, model):
        if model.training and torch.is_grad_enabled():
            self._flags(1, int(model._require_sync))
            self.steps += 1

    def _flags(self, training, will_sync):
        flags = torch.tensor([training, will_sync], dtype=torch.int64)
        self.model.group.all_reduce(flags, op="sum")
        return int(flags[0]), int(flags[1])

    def __exit__(self, exc_type, exc, tb):
        if not self.enable:
            return False
        self.model._joining = None
        if exc_type is not None:
            return False  # an error is not a join: do not shadow the others' collectives
        model, g = self.model, self.model.group
        while True:
            training, will_sync = self._flags(0, 0)
            if training == 0:
                break
            if will_sync:
                model._shadow_backward()
        most = torch.tensor([self.steps], dtype=torch.int64)
        g.all_reduce(most, op="max")
        src = torch.tensor([g.rank if self.steps == int(most) else g.world_size], dtype=torch.int64)
        g.all_reduce(src, op="min")
        model.sync_module_states(src=int(src))
        return False
