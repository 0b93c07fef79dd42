"""Top-k sparsification with error feedback (Lin et al., "Deep Gradient Compression",
arXiv 1712.01887).

Each rank sends only the k = ratio x n entries of largest magnitude of its
bucket, as (index, value) pairs: an all-gather of k int32 indices and k
values from every rank, then each rank adds them all up (the average of the
sparse gradients). What was not sent is not lost:

- **error feedback** (sec. 3.1, "gradient accumulation"): the unsent rest is
  kept as a residual and added to the next step's gradient, so every
  gradient entry is sent eventually, and the sum of what was sent plus the
  residual always equals the sum of the gradients;
- **momentum correction** (sec. 3.2, ``momentum=m``): the momentum is
  accumulated here, before the sparsification, as u = m u + g, v = v + u,
  and what is sent is top-k of v (use the optimizer without momentum then);
  the entries sent are cleared from u and v alike (momentum factor masking);
  ``paratrain train --compression topk`` with SGD runs it this way, since
  momentum applied after top-k loses accuracy (sec. 3.2);
- **warm-up** (sec. 3.3, ``warmup_steps``): the density starts at 25% (DGC's
  first warm-up epoch: 75% sparsity) and falls geometrically to ``ratio``
  over the first steps. Starting at 100% would send more than fp32 does
  (index and value for every entry). The momentum masking starts when the
  warm-up ends: masked at high density, nearly every entry is sent and
  cleared each step, which is SGD with no momentum; unmasked, density 1 is
  SGD's momentum exactly (tested);
- **small tensors whole** (``small_whole``, on by default): the smallest
  tensors of the model (biases, norms' scales, a small last layer), as many
  as together hold at most ``ratio`` of all its entries, are sent every step
  and never wait in the residual, and k is chosen among the rest. DGC's code
  compresses only tensors of two or more dimensions and PowerSGD sends small
  tensors whole; the budget bounds the cost: at most twice the entries. Picked
  from the whole bucket, a small tensor beside a large one (a last layer's
  bias) can lose the selection step after step while its residual grows.

Choosing the k largest is the costly part on a CPU: ``torch.topk`` over a
large bucket can take longer than sending the result over a slow link.
``largest`` follows DGC's sampled selection (sec. 5): the threshold is
estimated from a random sample, everything above it is taken as candidates
(one pass: a compare and a nonzero), and the exact top-k is then
chosen among the candidates, so the result is the true top-k whenever the
candidates are at least k (the threshold is set low enough that a shortfall
is five standard deviations away; if it happens, the full topk runs).
"""
import math

import torch

from ...trace import span
from .base import Compressor

SAMPLED_ABOVE = 100_000     # buckets smaller than this take the plain topk
SAMPLE_HITS = 400           # the sample holds this many of the top k, on average
MARGIN = 1.25               # candidates expected: MARGIN x k
WARMUP_START = 0.25         # the density of the warm-up's first step


def largest_naive(magnitude, k):
    """The indices of the k largest entries: one full selection."""
    return magnitude.topk(k, sorted=False).indices


def largest(magnitude, k, generator=None):
    """The indices of the k largest entries, as ``largest_naive``, by a sampled threshold."""
    n = magnitude.numel()
    if n < SAMPLED_ABOVE or k * 20 > n:
        return largest_naive(magnitude, k)
    samples = min(n, SAMPLE_HITS * n // k)
    sample = magnitude[torch.randint(n, (samples,), generator=generator)]
    hits = min(samples, int(k * samples / n * MARGIN) + 1)   # the sample's share of MARGIN x k
    threshold = sample.topk(hits, sorted=False).values.min()
    candidates = (magnitude >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return largest_naive(magnitude, k)
    return candidates[magnitude[candidates].topk(k, sorted=False).indices]


class TopK(Compressor):
    wants_shapes = True     # to find the small tensors (prepare)
    STATE = ("residual", "velocity", "steps")
    PER_RANK = ("residual", "velocity")

    def __init__(self, ratio=0.01, momentum=0.0, warmup_steps=0, small_whole=True):
        super().__init__()
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        if not 0 <= momentum < 1:
            raise ValueError(f"top-k momentum must be in [0, 1), got {momentum}")
        self.ratio, self.momentum, self.warmup_steps = ratio, momentum, int(warmup_steps)
        self.residual, self.velocity, self.steps = {}, {}, {}
        self.generator = torch.Generator().manual_seed(0)
        self.sent_k = {}
        self.small_whole = bool(small_whole)
        self.whole = {}                  # bucket index -> positions of its small tensors, sent every step

    def prepare(self, group, flats, shapes=None):
        """Choose the small tensors sent whole: the smallest first, while together they hold at
        most ``ratio`` of all the buckets' entries (one budget over the model, not per bucket:
        the first bucket holds the last layers)."""
        super().prepare(group, flats, shapes)
        self.whole = {}
        if not self.small_whole or shapes is None:
            return
        tensors = sorted((math.prod(shape), index, at) for index, runs in enumerate(self.layout)
                         for at, shape in runs)
        budget, taken = self.ratio * sum(n for n, _, _ in tensors), {}
        for n, index, at in tensors:
            if n > budget:
                break
            budget -= n
            taken.setdefault(index, []).append((at, n))
        self.whole = {index: torch.cat([torch.arange(at, at + n) for at, n in sorted(runs)])
                      for index, runs in taken.items()}

    def state_dict(self):
        return {**super().state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state):
        state = dict(state)
        if "generator" in state:
            self.generator.set_state(state.pop("generator"))
        super().load_state_dict(state)

    def density(self, step):
        if self.warmup_steps <= 0 or step >= self.warmup_steps:
            return self.ratio
        start = max(self.ratio, WARMUP_START)
        return start * (self.ratio / start) ** (step / self.warmup_steps)   # ratio at the end of warm-up

    def k_of(self, n, step):
        return max(1, min(n, int(round(self.density(step) * n))))

    def wire_bytes(self, flat):
        """What the last call sent for this bucket: the small tensors' values, and its k
        (at that step's density) as index and value."""
        whole, k = self.sent_k.get(id(flat), (0, self.k_of(flat.numel(), 0)))
        return whole * flat.element_size() + k * (4 + flat.element_size())

    def encode(self, index, flat):
        """This rank's (indices, values) for ``flat`` plus its residual; keeps the rest as the
        new residual (error feedback). Also what a parameter-server push sends (ps/push_codecs.py)."""
        n = flat.numel()
        step = self.steps.get(index, 0)
        acc = self.residual.get(index)
        if self.momentum:
            u = self.velocity.setdefault(index, torch.zeros_like(flat))
            u.mul_(self.momentum).add_(flat)
            acc = u.clone() if acc is None else acc.add_(u)
        else:
            acc = flat.clone() if acc is None else acc.add_(flat)
        # one k over the whole bucket, not DGC's k per layer: the budget goes to the largest
        # entries wherever they are, instead of the same share of every layer
        whole = self.whole.get(index)
        if whole is None:
            chosen = largest_k = largest(acc.abs(), self.k_of(n, step), self.generator)
        elif whole.numel() == n:            # a bucket of small tensors only: all of it
            chosen, largest_k = whole, whole[:0]
        else:
            magnitude = acc.abs()
            magnitude[whole] = -1.0         # never among the k largest: they go anyway
            largest_k = largest(magnitude, self.k_of(n - whole.numel(), step), self.generator)
            chosen = torch.cat([whole, largest_k])
        self.sent_k[id(flat)] = (chosen.numel() - largest_k.numel(), largest_k.numel())
        values = acc[chosen]
        acc[chosen] = 0.0                   # sent: what stays is the residual
        if self.momentum and step >= self.warmup_steps:
            self.velocity[index][largest_k] = 0.0   # momentum masking (the whole tensors keep theirs)
        self.residual[index] = acc
        self.steps[index] = step + 1
        self.sent[index] = (chosen, values)   # for tests: this rank's own contribution
        return chosen, values

    def __call__(self, group, index, flat):
        """The small tensors' values are all-reduced densely (every rank sends the same
        positions, so no indices go with them); the top k go as (index, value) pairs."""
        with span("topk encode", "compute", "compression", bucket=index):
            chosen, values = self.encode(index, flat)
        whole, k = self.sent_k[id(flat)]     # encode's count of each part
        dense = values[:whole].clone()     # values stay what this rank sent (self.sent)
        if whole:
            group.all_reduce(dense)
        flat.zero_()
        flat[chosen[:whole]] = dense
        if k:      # the same on every rank: k follows the bucket's size and the step
            all_idx = torch.empty(group.world_size * k, dtype=torch.int32)
            all_val = torch.empty(group.world_size * k, dtype=flat.dtype)
            group.all_gather(all_idx, chosen[whole:].to(torch.int32))
            group.all_gather(all_val, values[whole:].contiguous())
        with span("topk decode", "compute", "compression", bucket=index):
            if k:
                flat.index_add_(0, all_idx.long(), all_val)
            flat.div_(group.world_size)
