"""PowerSGD: low-rank gradients by one step of power iteration (Vogels et al.,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", arXiv 1905.13727, Algorithm 1).

Each gradient matrix M (m x n; a weight of more dimensions is viewed as
shape[0] x the rest) plus its residual is approximated as P Q^T of rank r:

    P = M Q;      P <- all-reduce mean;   P <- orthonormal basis of P
    Q = M^T P;    Q <- all-reduce mean;   M ~ P Q^T (the same on every rank)

so a rank sends (m + n) r numbers instead of m n. Q is kept for the next
step (warm start: one power-iteration step a training step converges over
time) and starts from the same random matrix on every rank. What this
rank's own projection missed stays as its residual (error feedback:
residual = M - P P^T M, added to the next gradient; the mean over ranks of
P P^T M is what P Q^T returns). Tensors where this would not save at
least ``min_ratio`` times the bytes (biases, norms, small layers) go
uncompressed in one all-reduce per bucket, as the paper and torch's hook
do. At full rank the approximation is exact: PowerSGD equals plain
averaging (tested).

The cost is a few passes over each matrix, so how each product runs
matters: torch's CPU matmul of a large matrix by a thin one (``M.T @ P``,
``M @ Q``) is many times slower than numpy's on the same memory, so both go
through numpy (``_times``); ``P Q^T`` is written straight into the bucket
and ``P P^T M`` taken off the residual in place (``addmm_``), with no
m x n temporary (``paratrain bench compression`` times it).
"""
import math

import torch

from ...trace import span
from .base import Compressor


class PowerSGD(Compressor):
    wants_shapes = True
    STATE = ("residual", "q")   # q: the warm start, the same on every rank
    PER_RANK = ("residual",)

    def __init__(self, rank=4, min_ratio=2.0, seed=0, keep_sent=False):
        super().__init__()
        if int(rank) < 1:
            raise ValueError(f"PowerSGD rank must be at least 1, got {rank}")
        self.rank, self.min_ratio, self.seed = int(rank), float(min_ratio), seed
        self.keep_sent = keep_sent   # fill self.sent (a copy of each bucket: for tests)
        self.residual, self.q, self.plans = {}, {}, []

    def prepare(self, group, flats, shapes=None):
        """shapes: for each bucket, its gradients' shapes in the order they lie in it."""
        super().prepare(group, flats, shapes)
        self.plans = []
        for runs in self.layout:
            mats, rest = [], []
            for at, shape in runs:
                n = math.prod(shape)
                rows = shape[0] if len(shape) >= 2 else 0
                cols = n // rows if rows else 0
                r = min(self.rank, rows, cols)
                if rows and rows * cols >= self.min_ratio * (rows + cols) * r:
                    mats.append((at, rows, cols, r))
                else:
                    rest.append((at, n))
            self.plans.append((mats, rest))

    def wire_bytes(self, flat):
        index = self._index.get(id(flat))
        if index is None:   # a copy of a bucket: the first plan of its size
            index = next(i for i, (mats, rest) in enumerate(self.plans)
                         if sum(m * n for _, m, n, _ in mats) + sum(n for _, n in rest) == flat.numel())
        mats, rest = self.plans[index]
        return (sum((m + n) * r for _, m, n, r in mats) + sum(n for _, n in rest)) * flat.element_size()

    def _start_q(self, index, j, cols, r):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 1009 + j)
        return torch.randn(cols, r, generator=gen)

    def __call__(self, group, index, flat):
        mats, rest = self.plans[index]
        acc = self.residual.get(index)
        acc = flat.clone() if acc is None else acc.add_(flat)
        before = acc.clone() if self.keep_sent else None
        if rest:   # small tensors: all-reduced whole, nothing left over
            plain = torch.cat([acc[at:at + n] for at, n in rest])
            group.all_reduce(plain, op="avg")
            got = 0
            for at, n in rest:
                flat[at:at + n].copy_(plain[got:got + n])
                acc[at:at + n] = 0.0
                got += n
        if mats:
            ms = [acc[at:at + m * n].view(m, n) for at, m, n, _ in mats]
            qs = [self.q.get((index, j)) for j in range(len(mats))]
            qs = [q if q is not None else self._start_q(index, j, n, r).to(flat.dtype)
                  for j, (q, (_, m, n, r)) in enumerate(zip(qs, mats))]
            with span("powersgd encode", "compute", "compression", bucket=index):
                local = [_times(m, q) for m, q in zip(ms, qs)]
            ps = self._mean(group, local)
            with span("powersgd encode", "compute", "compression", bucket=index):
                ps = [torch.linalg.qr(p).Q for p in ps]   # the same input on every rank: the same basis
                local = [_transposed_times(m, p) for m, p in zip(ms, ps)]
            qs = self._mean(group, local)
            with span("powersgd decode", "compute", "compression", bucket=index):
                for j, ((at, m, n, _), mat, p, q, mine) in enumerate(zip(mats, ms, ps, qs, local)):
                    torch.mm(p, q.T, out=flat[at:at + m * n].view(m, n))   # the mean of every rank's P P^T M
                    mat.addmm_(p, mine.T, alpha=-1)   # the residual: what this rank's own P P^T M missed
                    self.q[(index, j)] = q
        self.residual[index] = acc
        if before is not None:
            self.sent[index] = before.sub_(acc)   # this rank's own part: its small tensors, and P Q^T

    @staticmethod
    def _mean(group, tensors):
        """Every rank's tensors averaged, in one all-reduce."""
        joined = torch.cat([t.reshape(-1) for t in tensors])
        group.all_reduce(joined, op="avg")
        out, at = [], 0
        for t in tensors:
            out.append(joined[at:at + t.numel()].view_as(t))
            at += t.numel()
        return out


def _times(m, q):
    """M Q, by numpy's matmul on the same memory (see the module's note on speed)."""
    return torch.from_numpy(m.numpy() @ q.numpy())


def _transposed_times(m, p):
    """M^T P, as (P^T M)^T: read M row by row (torch's M.T @ P is far slower on a CPU)."""
    return torch.from_numpy((p.numpy().T @ m.numpy()).T)
