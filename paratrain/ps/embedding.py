"""``pt.ps.Embedding``: an embedding table whose rows live on the parameter servers.

    emb = pt.ps.Embedding(10_000_000, 64)    # nothing is allocated here
    model = Recommender(emb, ...)
    ps.register(model, optimizer="adagrad", lr=0.05)
    ps.pull(model); loss(model(batch)).backward(); ps.push(model); ps.clock()

A forward looks up only the batch's rows: it pulls their current values
from the servers (row r from server r % S), makes them one small leaf tensor
that autograd fills with their gradient, and indexes it. ``ps.push`` then
sends exactly those rows' gradients, so a step moves O(rows in the batch x
dim) bytes, not the table (Li et al., OSDI 2014, sec. 2: workers "only
compute and communicate the parameters that appear in their data"). This is
what ``torch.nn.Embedding(sparse=True)`` does inside one process, with the
table itself out of the process.

Rows start as N(0, std^2) (torch.nn.Embedding's init with std=1); each
element comes from a counter-based generator keyed by (seed, table, row,
column), so ``initial_rows`` gives any row's starting value anywhere.
"""
import numpy as np
import torch

from .rows import initial_rows


class Embedding(torch.nn.Module):
    """``num_embeddings`` rows of ``embedding_dim`` floats, on the parameter servers.

    std: the initial rows' standard deviation (default 1, as torch.nn.Embedding);
    seed: with the table's registration order, fixes every row's initial value."""

    def __init__(self, num_embeddings, embedding_dim, std=1.0, seed=0):
        super().__init__()
        if int(num_embeddings) < 1 or int(embedding_dim) < 1:
            raise ValueError(f"Embedding needs num_embeddings >= 1 and embedding_dim >= 1, "
                             f"got {num_embeddings} x {embedding_dim}")
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.std, self.seed = float(std), int(seed)
        self.client = None
        self.key = None
        self._used = []   # (unique row ids, their leaf tensor) of each forward since the last push

    def spec(self):
        return {"num": self.num_embeddings, "dim": self.embedding_dim, "seed": self.seed, "std": self.std}

    def attach(self, client, key):
        """Called by ``register``: the client that serves this table, and its key."""
        self.client, self.key = client, key
        self._used = []

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, on parameter servers"

    def forward(self, ids):
        if self.client is None:
            raise RuntimeError("this pt.ps.Embedding is not registered: call ps.register(model, ...) on a model "
                               "that contains it before the first forward")
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"embedding ids must be int64 or int32, not {ids.dtype}")
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"embedding ids must lie in [0, {self.num_embeddings}), got "
                             f"[{int(flat.min())}, {int(flat.max())}]")
        rows, inverse = torch.unique(flat, return_inverse=True)
        values = torch.from_numpy(self.client.pull_rows(self.key, rows.numpy()))
        if torch.is_grad_enabled():
            values.requires_grad_(True)
            self._used.append((rows, values))
        return values[inverse].reshape(*ids.shape, self.embedding_dim)

    def take_gradients(self):
        """(row ids, their summed gradients) of every forward since the last call, as
        numpy arrays; rows whose values received no gradient are left out."""
        used, self._used = self._used, []
        pairs = [(r, v.grad) for r, v in used if v.grad is not None]
        if not pairs:
            return np.zeros(0, np.int64), np.zeros((0, self.embedding_dim), np.float32)
        rows = torch.cat([r for r, _ in pairs])
        grads = torch.cat([g for _, g in pairs])
        return rows.numpy(), grads.numpy()

    def initial(self, rows):
        """The initial values of ``rows`` (what a pull of a never-touched row returns)."""
        return initial_rows(self.seed, self.key if self.key is not None else 0, rows, self.embedding_dim, self.std)
