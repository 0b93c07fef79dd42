"""The vocabulary cut across a group: an embedding table by rows, and a
cross-entropy that never gathers the full logits (Megatron-LM, arXiv
1909.08053, sec. 3: "parallelizing the output embedding").

- ``VocabParallelEmbedding(V, d)``: rank r holds rows r*V/p .. (r+1)*V/p - 1.
  Each rank looks up the ids in its range (the others give zero rows) and an
  all-reduce sums the p partial results: every rank ends with every id's row.
  A ``padding_idx`` is kept as ``nn.Embedding`` keeps it: its row's gradient
  stays zero, masked on the one rank that holds the row (a tied decoder may
  still train it, as it does in one process). ``max_norm``,
  ``scale_grad_by_freq`` and ``sparse`` would need every rank's ids or rows
  at once, and are refused.
- ``vocab_parallel_cross_entropy(logits, target, group)``: the logits of a
  column-parallel head are cut along the vocabulary, rank r holding its V/p
  columns. The softmax denominator is the all-reduce of the ranks' local sums
  of exp (after subtracting the all-reduced maximum, for stability), and the
  target's logit is the all-reduce of the one rank holding it: per token, 2
  floats each instead of V. The gradient is computed in place, softmax minus
  the one-hot target, on the rank's own columns.
"""
import torch
from torch import nn

from . import functional as tpf
from .layers import _divisible, _size_of

UNSUPPORTED = {"max_norm": None, "scale_grad_by_freq": False, "sparse": False}   # nn.Embedding's options, and off


def check_embedding(embedding, p):
    """Raise the ValueError cutting ``embedding`` into ``p`` would: a vocabulary ``p`` does
    not divide, or an option no rank can honour alone."""
    unsupported = [f"{name}={getattr(embedding, name)!r}" for name, off in UNSUPPORTED.items()
                   if getattr(embedding, name, off) != off]
    if unsupported:
        raise ValueError(f"VocabParallelEmbedding: an embedding with {', '.join(unsupported)} cannot be cut by "
                         "rows (each rank sees only its rows of the vocabulary); leave it whole (no 'vocab' in "
                         "the plan) or build it without them")
    return _divisible(embedding.num_embeddings, p, "num_embeddings", "VocabParallelEmbedding")


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, group=None, padding_idx=None):
        super().__init__()
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)   # the one-process initialisation
        self._shard(full, group)

    @classmethod
    def from_embedding(cls, embedding, group=None):
        """This rank's rows of an existing nn.Embedding."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._shard(embedding, group)
        return layer

    def _shard(self, full, group):
        self.group, p, r = _size_of(group)
        self.num_embeddings, self.embedding_dim = full.num_embeddings, full.embedding_dim
        per = check_embedding(full, p)
        self.start, self.end = r * per, (r + 1) * per
        self.padding_idx = full.padding_idx   # nn.Embedding's, already made non-negative
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.end].clone())

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        mine = self.padding_idx is not None and self.start <= self.padding_idx < self.end
        rows = nn.functional.embedding(local, self.weight, padding_idx=self.padding_idx - self.start if mine else None)
        return tpf.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self):
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad} (rows {self.start}..{self.end - 1} on this rank)"


def _reduce(group, t, op):
    with tpf.traffic.moving("all_reduce", t):
        group.all_reduce(t, op=op)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, start):
        logits = logits.detach()
        biggest = logits.max(dim=-1).values
        _reduce(group, biggest, "max")
        shifted = logits - biggest.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        _reduce(group, total, "sum")
        n = logits.shape[-1]
        inside = (target >= start) & (target < start + n)
        local = (target - start).masked_fill(~inside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        _reduce(group, picked, "sum")
        softmax = exp / total.unsqueeze(-1)
        ctx.save_for_backward(softmax, local, inside)
        return total.log() - picked          # per token: log sum exp - the target's logit

    @staticmethod
    def backward(ctx, g):
        softmax, local, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, target, group=None, reduction="mean"):
    """Cross-entropy of logits cut along the vocabulary (this rank's V/p columns,
    rank order) against full target ids; the same loss on every rank."""
    group, p, r = _size_of(group)
    per_token = _VocabParallelCrossEntropy.apply(logits, target, group, r * logits.shape[-1])
    if reduction == "mean":
        return per_token.mean()
    if reduction == "sum":
        return per_token.sum()
    if reduction == "none":
        return per_token
    raise ValueError(f"vocab_parallel_cross_entropy: reduction must be mean, sum or none, got {reduction!r}")
