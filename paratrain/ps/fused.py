"""A server's dense shards stepped as one: one optimizer call over all of them.

A server holds one shard per tensor piece (gpt: 53 of them), each with its own
optimizer (optimizers.py). Applying a BSP round shard by shard makes about ten
torch calls per shard, and on small tensors the calls cost more than their
arithmetic: Adam over gpt's 0.87 M parameters takes 5.1 ms shard by shard and
3.3 ms in one call (this machine, one thread). torch's ``foreach`` optimizers
group their tensors for the same reason (Li et al., "PyTorch Distributed",
VLDB 2020, bucket gradients for the same saving on the wire).

So the shards' values are views of one buffer (the shared segment's, or one
copy), and here their round sums and optimizer state are views of one buffer
each too. When a push completes every shard's round at once (a worker's push of
all its pieces in one message: through the shared segment, or compressed), the
average is applied by one optimizer step over the whole buffer. Elementwise
arithmetic does not care where a buffer is cut, so the weights are bitwise
those of the shard-by-shard steps, which remain for rounds that complete piece
by piece (one TCP message a piece) and after a restart's resynchronisation.

Under ASP and SSP each push is applied on arrival, at 1/W of the learning rate
(shard.py's apply_now): a push of every piece is then one step over the whole
buffer too (``apply_push``), unless the servers predict weights, whose
bookkeeping is a shard's own.
"""
import numpy as np

from .optimizers import make_optimizer


class FusedRounds:
    """``shards`` (in buffer order) whose values are consecutive views of ``values``."""

    def __init__(self, shards, values, optimizer, hyper):
        self.shards, self.value = list(shards), values
        self.sum = np.zeros_like(values)
        self.opt = make_optimizer(optimizer, **hyper)
        self.rounds = 0   # rounds (BSP) or pushes (ASP, SSP) stepped as one (the server's stats report it)
        at = 0
        for shard in self.shards:
            n = shard.hi - shard.lo
            if not np.shares_memory(shard.value, values[at:at + n]):
                raise ValueError(f"shard {shard.key}:{shard.lo} is not at {at} of the server's buffer")
            shard.sum = self.sum[at:at + n]
            at += n
        self.link()

    def link(self):
        """Point every shard's optimizer state at its part of the one state buffer, with what
        the shard held copied in (after a checkpoint's load_state_dict gave it arrays of its own)."""
        flat = dict(zip(self.opt.ARRAYS, self.opt._arrays(self.value.size)))
        at = 0
        for shard in self.shards:
            n = shard.hi - shard.lo
            for name, whole in flat.items():
                part, mine = whole[at:at + n], shard.opt.state.get(name)
                if mine is not None and not np.shares_memory(mine, part):
                    part[:] = mine
                shard.opt.state[name] = part
            at += n

    def apply_if_complete(self, ready):
        """Step every shard as one if all have the same complete round (``ready(clock,
        pushed)``: the consistency model's word) and the same step count; True if it did."""
        first = self.shards[0]
        if not first.pushed or not ready(first.applied, first.pushed):
            return False
        if any(s.applied != first.applied or s.pushed != first.pushed or s.opt.steps != first.opt.steps
               for s in self.shards):
            return False
        self.opt.steps = first.opt.steps
        self.opt.step(self.value, self.sum, grad_scale=1.0 / len(first.pushed))
        for s in self.shards:
            s.opt.steps += 1
            s.clear_round()
            s.applied += 1
        self.rounds += 1
        return True

    def apply_push(self, grad, lr_scale):
        """ASP / SSP: one worker's push of every shard (``grad``, in buffer order) applied on
        arrival by one step at ``lr_scale`` of the learning rate, as each shard's
        apply_now would; True if it did (False: the shards' step counts differ, after
        pushes that came piece by piece, and each shard steps its own)."""
        steps = self.shards[0].opt.steps
        if any(s.opt.steps != steps for s in self.shards):
            return False
        self.opt.steps = steps
        self.opt.step_lr_scaled(self.value, grad, lr_scale)
        for s in self.shards:
            s.opt.steps += 1
        self.rounds += 1
        return True
