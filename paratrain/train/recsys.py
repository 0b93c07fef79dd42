"""``--model recsys``: click prediction over a large, sparsely used embedding table.

The data are synthetic but shaped like a recommender's: every sample has
FIELDS categorical features (user, item, context...), each an id into one
shared vocabulary of NUM_IDS, drawn from a Zipf law (a few ids are very
common, most are rare; Zipf exponent 1.05, as word and item frequencies
typically are), and a click label drawn from a logistic teacher that gives
every id a hidden effect. A model learns it by learning each seen id's
embedding: the table is 1M x 64 floats (256 MB), but a batch of 64 samples
touches a few hundred rows.

The model embeds the FIELDS ids, concatenates them and scores the result with
a small MLP (the embedding-plus-MLP shape of Wide&Deep / DLRM, Naumov et al.,
arXiv 1906.00091). With ``sparse=True`` (``--strategy ps``) the table is a
``pt.ps.Embedding``: its rows live on the parameter servers and only the
batch's rows move. Otherwise it is a dense ``torch.nn.Embedding`` whose whole
gradient is all-reduced every step, which is what the benchmark compares;
both start from the same rows (``paratrain.ps.rows.initial_rows``).
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_IDS = 1_000_000
DIM = 64
FIELDS = 8
ZIPF = 1.05
TRAIN, EVAL = 200_000, 10_000
INIT_STD = 0.01
SEED = 11


def zipf_ids(n, num_ids, exponent, rng):
    """n ids in [0, num_ids) with P(rank k) proportional to 1 / k^exponent, the ranks
    scattered over the id space by a fixed permutation (hot ids are not 0, 1, 2...)."""
    weights = 1.0 / np.arange(1, num_ids + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), num_ids - 1)
    return np.random.default_rng(SEED).permutation(num_ids)[ranks]


def click_data(num_ids=NUM_IDS, fields=FIELDS, train=TRAIN, evaluation=EVAL):
    """(train, eval) TensorDatasets of (ids (n, fields) int64, clicked (n,) float32)."""
    rng = np.random.default_rng(SEED)
    effect = rng.normal(0.0, 1.0, num_ids).astype(np.float32)   # the teacher's hidden per-id effect
    ids = zipf_ids((train + evaluation) * fields, num_ids, ZIPF, rng).reshape(-1, fields)
    logit = 2.0 * effect[ids].sum(1) / np.sqrt(fields)
    clicked = (rng.random(len(ids)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    t = torch.from_numpy
    return (torch.utils.data.TensorDataset(t(ids[:train]), t(clicked[:train])),
            torch.utils.data.TensorDataset(t(ids[train:]), t(clicked[train:])))


class ClickModel(nn.Module):
    """ids (B, FIELDS) -> click logit (B,): embed, concatenate, MLP."""

    def __init__(self, embedding, fields=FIELDS, dim=DIM, hidden=64):
        super().__init__()
        self.emb = embedding
        self.mlp = nn.Sequential(nn.Linear(fields * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids):
        return self.mlp(self.emb(ids).flatten(1)).squeeze(-1)


def make_embedding(sparse, num_ids=NUM_IDS, dim=DIM):
    """The table: on the parameter servers (sparse) or a dense nn.Embedding with the same rows."""
    from ..ps import Embedding
    from ..ps.rows import initial_rows
    if sparse:
        return Embedding(num_ids, dim, std=INIT_STD, seed=SEED)
    dense = nn.Embedding(num_ids, dim)
    with torch.no_grad():
        for lo in range(0, num_ids, 1 << 13):   # in chunks whose temporaries stay in the caches
            hi = min(num_ids, lo + (1 << 13))
            dense.weight[lo:hi] = torch.from_numpy(initial_rows(SEED, 0, np.arange(lo, hi), dim, INIT_STD))
    return dense


def click_loss(model, batch):
    ids, clicked = batch
    return F.binary_cross_entropy_with_logits(model(ids), clicked)


def click_eval(dataset, chunk=2048):
    """evaluate(model) -> accuracy and mean log-loss on the evaluation clicks."""
    ids_all, y_all = dataset.tensors

    def run(model):
        was = model.training
        model.eval()
        loss, correct = 0.0, 0
        try:
            with torch.no_grad():
                for i in range(0, len(y_all), chunk):
                    logit, y = model(ids_all[i:i + chunk]), y_all[i:i + chunk]
                    loss += F.binary_cross_entropy_with_logits(logit, y, reduction="sum").item()
                    correct += ((logit > 0).float() == y).sum().item()
        finally:
            model.train(was)
        return {"accuracy": correct / len(y_all), "eval_loss": loss / len(y_all)}
    return run
