"""A predicted training step, whatever the strategy: its parts, and what they give.

Every strategy here keeps one device's batch per device (``batch_per_device``
samples for each of the ``workers``: a pipeline's or a tensor group's batch
is its devices' batches together), so the compute per device is the same as
one device's alone and scaling efficiency is compute / step.

``Unavailable`` is a strategy that cannot run the workload on those workers,
with the reason (the user sees it in place of a row).
"""
from dataclasses import dataclass


class Unavailable(ValueError):
    """This strategy cannot run this workload on these workers; the message says why."""


@dataclass(frozen=True)
class Step:
    workers: int
    compute_s: float            # forward + backward of one device's batch (its share, cut or not)
    exposed_s: float = 0.0      # communication nothing hid
    bubble_s: float = 0.0       # a pipeline's idle time, filling and draining
    comm_s: float = 0.0         # every transfer's time, hidden or not
    how: str = ""               # the algorithm or layout the prediction is for
    batch_per_device: int = 1
    extra_s: float = 0.0        # compute a strategy adds (compression's encoding, the servers' update)
    wait_s: float = 0.0         # waiting for the slowest rank at each synchronization (waits.py)

    @classmethod
    def alone(cls, workload, how="none"):
        """One device on its own: all compute, nothing to send."""
        return cls(1, workload.step_compute_s, how=how, batch_per_device=workload.batch_per_device)

    PARTS = ("compute", "extra", "exposed", "bubble", "wait")   # what a step's seconds add up from

    @property
    def parts(self):
        """{part: seconds} of the step, PARTS in order; they add up to step_s."""
        return {part: getattr(self, part + "_s") for part in self.PARTS}

    @property
    def step_s(self):
        return sum(self.parts.values())

    @property
    def samples_per_s(self):
        return self.workers * self.batch_per_device / self.step_s

    @property
    def efficiency(self):
        return self.compute_s / self.step_s


def serial_channel(jobs):
    """When each transfer ends on one channel that runs one at a time, in order:
    ``jobs`` is [(ready time, seconds)]; a transfer starts when it is ready and
    the one before it has ended (as DDP's buckets, ZeRO's gathers and
    reduce-scatters each go one after another on their stream)."""
    free, ends = 0.0, []
    for ready, seconds in jobs:
        free = max(free, ready) + seconds
        ends.append(free)
    return ends
