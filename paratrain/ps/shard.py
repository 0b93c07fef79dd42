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
        self.ahead = {}       # SSP: clock -> (sum, workers) of the clocks after ``applied``

    def pushed_for(self, clock):
        return self.pushed if clock == self.applied else self.ahead.get(clock, (None, set()))[1]

    def gather(self, worker, grad, clock=None):
        """Add a gradient to its clock's round (SSP lets workers push up to s clocks ahead)."""
        if clock is not None and clock != self.applied:
            total, workers = self.ahead.get(clock, (None, set()))
            if total is None:
                total = np.array(grad, dtype=np.float32)
            else:
                total += grad
            workers.add(worker)
            self.ahead[clock] = (total, workers)
            return
        if self.pushed:
            self.sum += grad
        else:   # the round's first gradient: a copy, so the sum needs no zeroing between rounds
            np.copyto(self.sum, grad)
        self.pushed.add(worker)

    def apply_round(self):
        """BSP: apply the average of the round's gradients as one update (in place: a
        shard-sized temporary per update costs more than the arithmetic)."""
        np.divide(self.sum, len(self.pushed), out=self.sum)
        self.opt.step(self.value, self.sum)
        self.pushed = set()
        self.applied += 1
        total, workers = self.ahead.pop(self.applied, (None, set()))
        if total is not None:   # the next clock's round, gathered while this one waited
            np.copyto(self.sum, total)
            self.pushed = workers

    def clear_round(self):
        """Drop the rounds being gathered (a restarted server resynchronising)."""
        self.pushed = set()
        self.ahead.clear()
