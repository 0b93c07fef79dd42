"""One dense shard on a server: elements [lo, hi) of a parameter, its optimizer,
and the BSP round being gathered (Ho et al., NIPS 2013: a clock's pushes are
summed and applied once, as their average, when every worker has pushed).

Weight prediction (ASP/SSP, opt-in): a gradient pushed on arrival is computed
on weights that other workers' pushes have since moved, tau updates ago. Adam
follows its momentum, so the next updates look much like the last one; the
shard keeps that last update, delta, and serves a worker the weights it will
most likely be applied to, value + tau * delta, with tau the number of other
pushes that came between this worker's reads and its pushes (a running mean
over its last few steps, starting from W - 1, the round-robin value, so one
jittery step does not swing it; a persistent straggler's grows to what it is).
That is SpecTrain's weight prediction (Chen et al., "Efficient and Robust
Parallel DNN Training through Model Parallelism on Multi-GPU Platform",
arXiv 1809.02839, 2018, sec. 4), here with the last update as the direction
(benchmarks/stale_gradients.py replays what it recovers). The shard's own
value is never changed by it: a read with ``exact`` (the final pull of a run)
gets the weights as they are, and checkpoints save them.

With a momentum optimizer the read looks mu updates further still, value +
(tau + mu) * delta, mu the momentum coefficient (Adam's beta1, SGD's
momentum; ``lookahead`` on the optimizers): a gradient is folded into the
momentum and moves the weights over the next updates, so like Nesterov's
method (Sutskever et al., ICML 2013) it is best taken ahead of where it will
be applied, a step further than prediction alone. DANA (Hakimi et al.,
"Taming Momentum in a Distributed Asynchronous Environment", arXiv
1907.11612, 2019) builds its asynchronous look-ahead on the same Nesterov
step (benchmarks/ssp_simulation.py and table 3 of
benchmarks/parameter_server.py measure it).

What prediction misses, the other workers' fresh gradient noise, is damped
as Gap-Aware staleness mitigation does (Barkai, Hakimi and Schuster, "Gap
Aware Mitigation of Gradient Staleness", ICLR 2020): each element of a pushed
gradient is divided by its *gap*, max(1, |value - served| / step), where
served is what this worker was given to compute on and step a running mean of
the element's update size (|delta|), so elements the prediction got wrong by
more than a typical update move less. It damps the prediction's errors,
so it comes only with prediction.
"""
import numpy as np
import torch

from .optimizers import _tensor

GAP_WARMUP = 10       # pushes before the gap is trusted (the mean update size starts at zero)
STEP_SIZE_DECAY = 0.9  # the running mean of |update| per element: step = 0.9 step + 0.1 |delta|


class Shard:
    """Elements [lo, hi) of parameter ``key``: the values, their optimizer, the BSP
    accumulator of the clock being gathered, and (ASP/SSP with prediction) the last
    update and each worker's staleness."""

    def __init__(self, key, lo, hi, values, optimizer):
        self.key, self.lo, self.hi = key, lo, hi
        self.value = values
        self.opt = optimizer
        self.applied = 0      # BSP: clocks whose average has been applied
        self.sum = np.zeros_like(values)
        self.pushed = set()   # BSP: workers whose gradient for clock ``applied`` is in ``sum``
        self.delta = None     # ASP/SSP with weight prediction: the last update (enable_prediction)

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

    # ---- ASP / SSP: each push on arrival, with optional weight prediction ----------

    def enable_prediction(self, workers):
        self.delta = np.zeros_like(self.value)
        self.updates = 0                     # pushes applied so far
        self.read_at = [0] * workers         # ``updates`` at each worker's last (predicted) read
        self.tau = [float(workers - 1)] * workers   # other workers' pushes between its read and its push
        self.served = [None] * workers       # what each worker was last given to compute on
        self.step_size = np.zeros_like(self.value)   # running mean of |delta| per element (the gap's unit)
        self.lookahead = self.opt.lookahead   # Nesterov's mu updates further (the momentum coefficient)

    def apply_now(self, worker, grad, lr_scale):
        """One push applied on arrival with the learning rate times ``lr_scale``; with
        prediction, also how stale it was and the update it made."""
        if self.delta is None:
            self.opt.step_lr_scaled(self.value, grad, lr_scale)
            return
        self.tau[worker] = 0.5 * (self.tau[worker] + (self.updates - self.read_at[worker]))
        if self.served[worker] is not None and self.updates >= GAP_WARMUP:
            grad = self.gap_damped(grad, self.served[worker])
        np.copyto(self.delta, self.value)
        self.opt.step_lr_scaled(self.value, grad, lr_scale)
        np.subtract(self.value, self.delta, out=self.delta)
        step = torch.from_numpy(self.step_size)
        step.mul_(STEP_SIZE_DECAY).add_(torch.from_numpy(self.delta).abs(), alpha=1 - STEP_SIZE_DECAY)
        self.updates += 1

    def gap_damped(self, grad, served):
        """grad / max(1, |value - served| / step), elementwise (a new array)."""
        gap = torch.from_numpy(self.value).sub(torch.from_numpy(served)).abs_()
        gap.div_(torch.from_numpy(self.step_size).add(1e-12)).clamp_(min=1.0)
        return _tensor(grad).div(gap).numpy()   # (a gradient received over TCP is read-only)

    def read_into(self, worker, out, exact=False):
        """The weights ``worker`` should compute on, into ``out``: the value itself, or
        with prediction (and not ``exact``) value + (tau + lookahead) * delta."""
        if self.delta is not None:   # the worker's pull region, or the snapshot sent: neither
            self.served[worker] = out   # changes until its next read, which comes after its push
        if self.delta is None or exact:
            np.copyto(out, self.value)
            return out
        self.read_at[worker] = self.updates
        ahead = self.tau[worker] + self.lookahead
        torch.add(torch.from_numpy(self.value), torch.from_numpy(self.delta), alpha=ahead, out=torch.from_numpy(out))
        return out
