"""One dense shard on a server: elements [lo, hi) of a parameter, its optimizer,
and the BSP round being gathered (Ho et al., NIPS 2013: a clock's pushes are
summed and applied once, as their average, when every worker has pushed)."""
import numpy as np


class Shard:
    """Elements [lo, hi) of parameter ``key``: the values, their optimizer, and the
    BSP accumulator of the clock being gathered."""

    def __init__(self, key, lo, hi, values, optimizer):
        self.key, self.lo, self.hi = key, lo, hi
        self.value = values
        self.opt = optimizer
        self.applied = 0      # BSP: clocks whose average has been applied
        self.sum = np.zeros_like(values)
        self.pushed = set()   # BSP: workers whose gradient for clock ``applied`` is in ``sum``

    def gather(self, worker, grad):
        if self.pushed:
            self.sum += grad
        else:   # the round's first gradient: a copy, so the sum needs no zeroing between rounds
            np.copyto(self.sum, grad)
        self.pushed.add(worker)

    def apply_round(self):
        """BSP: apply the average of the round's gradients as one update, the 1/W folded
        into the optimizer's arithmetic (no pass of its own), in place: a shard-sized
        temporary per update costs more than the arithmetic."""
        self.opt.step(self.value, self.sum, grad_scale=1.0 / len(self.pushed))
        self.clear_round()
        self.applied += 1

    def clear_round(self):
        self.pushed.clear()
